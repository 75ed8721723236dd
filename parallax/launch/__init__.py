"""Starting and watching jobs: the `parallax` command line, the launcher (`run`) and its
backends (local processes, ssh hosts, Kubernetes manifests), the cluster description that
reaches every process, restarts, status, progress and logs.
"""
