"""Starting and watching jobs: the launcher (`run`) and its backends (local processes, ssh
hosts, Kubernetes manifests and the gang bootstrap), restarts, status and progress. The
`parallax` command itself is `parallax.cli`; where the servers are is `parallax.client.cluster`.
"""
