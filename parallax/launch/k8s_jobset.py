"""`parallax k8s --format jobset`: the job as one JobSet (jobset.x-k8s.io/v1alpha2, the
JobSet controller MIN_JOBSET or newer), for clusters that run that controller.

    JobSet JOB
      replicatedJobs  ps      1 indexed Job of S servers (none with --servers 0)
                      worker  1 indexed Job of N workers, created once every server is
                              Ready (dependsOn: the servers' readiness probe says SERVING)
      network         enableDNSHostnames, subdomain JOB: the JobSet's own headless Service
                      JOB gives pod i of each Job the name JOB-<ps|worker>-0-<i>.JOB.<ns>.svc
                      (k8s_labels.pod_host), published before the pods are ready
      successPolicy   All of `worker`: the JobSet completes when the workers have, and the
                      controller then deletes the servers' Job (its pods stop gracefully)
      failurePolicy   maxRestarts = --max-restarts: a failed Job restarts the whole JobSet
                      (every Job recreated, BlockingRecreate: the old pods are gone before
                      the new ones start, so no two pods answer to one name); with
                      --max-restarts, a worker Job failed by its podFailurePolicy (the gang
                      already restarted in place N times, or cannot start) fails the JobSet
                      at once instead

What --format job needs and this does not: the servers' job watcher, its ServiceAccount,
Role and RoleBinding (the JobSet controller ends the servers), and the two headless Services
(the JobSet makes one). The JobSet's status (`kubectl get jobset JOB`: TerminalState,
Restarts) is the job's outcome. The spec of each Job is k8s_render's; this module only
knows the JobSet API.
"""
from __future__ import annotations

from typing import Any, Mapping

from parallax.launch.k8s_config import JOBSET_API, K8sConfig
from parallax.launch.k8s_labels import subdomain

# The failurePolicy rule for a worker Job that its podFailurePolicy failed (FailJob): the
# gang gave up after its in-place restarts, so recreating everything would only repeat it.
GANG_GAVE_UP = {"name": "GangGaveUp", "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "targetReplicatedJobs": ["worker"]}


def failure_policy(config: K8sConfig) -> dict[str, Any]:
    """maxRestarts = --max-restarts; with restarts, whole-set recreation that waits for
    the old pods, and no restart after the gang gave up (GANG_GAVE_UP)."""
    policy: dict[str, Any] = {"maxRestarts": config.max_restarts}
    if config.max_restarts:
        policy["restartStrategy"] = "BlockingRecreate"
        policy["rules"] = [dict(GANG_GAVE_UP)]
    return policy


def jobset(config: K8sConfig, specs: Mapping[str, dict[str, Any]],
           metadata: dict[str, Any]) -> dict[str, Any]:
    """The JobSet: one replicated Job (replicas 1) per entry of `specs` ("ps", then
    "worker": a Job spec each), the workers depending on the servers being Ready."""
    replicated = []
    for name, spec in specs.items():
        job: dict[str, Any] = {"name": name, "replicas": 1,
                               "template": {"metadata": {"labels": dict(
                                   spec["template"]["metadata"]["labels"])}, "spec": spec}}
        if name == "worker" and "ps" in specs:
            job["dependsOn"] = [{"name": "ps", "status": "Ready"}]
        replicated.append(job)
    return {"apiVersion": JOBSET_API, "kind": "JobSet", "metadata": metadata, "spec": {
        "network": {"enableDNSHostnames": True, "subdomain": subdomain(config, "worker"),
                    "publishNotReadyAddresses": True},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": ["worker"]},
        "failurePolicy": failure_policy(config),
        "replicatedJobs": replicated,
    }}
