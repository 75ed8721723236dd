"""The objects of one `parallax k8s` job, in the order to apply them (`render`), and their
YAML (`dump`); the module docstring of parallax.launch.k8s lists them. Validation and the
settings they derive from: parallax.launch.k8s_config."""
from __future__ import annotations

import json
from typing import Any, Mapping

import yaml

from parallax.env import (ADDRESSES_ENV, CONNECT_TIMEOUT_ENV, HELD_BACKUPS_ENV, JOB_CONFIG_ENV,
                          MAX_RESTARTS_ENV, MODE_ENV, RENDEZVOUS_ENV, REPLAY_ENV, REPLICAS_ENV,
                          RUN_ID_ENV, SYNC_ENV, WARM_STARTS_ENV, WORKERS_ENV)
from parallax.launch import gang
from parallax.launch import k8s_jobset, k8s_patch
from parallax.launch import k8s_security as secure
from parallax.launch.k8s_config import (CONFIG_DIR, CONFIG_FILE, DEFAULT_DATA_DIR,
                                        GPU_RESOURCE, IMAGE_UID, K8sConfig, elastic,
                                        node_selector, resource_setting, server_metrics_port,
                                        tolerations, validate, worker_bounds)
from parallax.launch.k8s_labels import labels as _labels
from parallax.launch.k8s_labels import meta as _meta
from parallax.launch.k8s_labels import parse_selector, pod_host, subdomain
from parallax.launch.k8s_watch import SERVICE_ACCOUNT_DIR

WATCHER = {"requests": {"cpu": "10m", "memory": "64Mi"},   # `parallax k8s watch-job`:
           "limits": {"cpu": "100m", "memory": "128Mi"}}  # ~55 MB resident, idle


def server_data_dir(config: K8sConfig) -> str | None:
    """Where the servers keep checkpoints: --data-dir, else DEFAULT_DATA_DIR when a volume,
    restarts or replays (--replay-mb) need one, else None (no checkpoints on the servers)."""
    if not config.servers:
        return None
    if config.data_dir or config.data_volume_size or config.max_restarts or config.replay_mb:
        return config.data_dir or DEFAULT_DATA_DIR
    return None


def ps_service_host(config: K8sConfig, index: int) -> str:
    """Server pod `index`'s stable DNS name (k8s_labels.pod_host, in the cluster's domain)."""
    return f"{pod_host(config, 'ps', index)}.{config.namespace}.svc.{config.cluster_domain}"


def ps_addresses(config: K8sConfig) -> list[str]:
    return [f"{ps_service_host(config, i)}:{config.server_port}" for i in range(config.servers)]


def worker_host(config: K8sConfig, index: int) -> str:
    """Worker pod `index`'s stable DNS name: an indexed Job's pod is named <job>-<index>;
    with `subdomain` it resolves as <job>-<index>.<subdomain>.<namespace>.svc.<domain>"""
    return f"{pod_host(config, 'worker', index)}.{config.namespace}.svc.{config.cluster_domain}"


def rendezvous_address(config: K8sConfig) -> str:
    return f"{worker_host(config, 0)}:{config.rendezvous_port}"


def collective_addresses(config: K8sConfig) -> list[str]:
    """Every worker's TensorFlow server, in rank order (--collectives tensorflow)."""
    return [f"{worker_host(config, i)}:{config.collective_port}" for i in range(config.workers)]


def job_config(config: K8sConfig) -> dict[str, Any]:
    """What the ConfigMap's job.json holds."""
    return {
        "name": config.name, "namespace": config.namespace, "mode": config.mode,
        "sync": config.sync, "workers": config.workers, "servers": config.servers,
        "server_port": config.server_port, "ps_addresses": ps_addresses(config),
        "run_id": config.name, "plan": dict(config.plan), "command": list(config.command),
        **_elastic_sizes(config),
    }


def _elastic_sizes(config: K8sConfig) -> dict[str, int]:
    """An elastic Job's bounds, in job.json ("workers": the count it started with)."""
    if not elastic(config):
        return {}
    least, most = worker_bounds(config)
    return {"min_workers": least, "max_workers": most}


def _horovod(config: K8sConfig) -> bool:
    """Whether the workers may form a Horovod job: more than one of them, now or once the
    Job is scaled up (--max-np)."""
    return worker_bounds(config)[1] > 1 and config.collectives == "horovod"


def _gang(config: K8sConfig) -> bool:
    """Whether worker 0 coordinates a gang: restarts (--max-restarts) or an elastic count."""
    return bool(config.max_restarts) or elastic(config)


def _headless_service(config: K8sConfig, name: str, role: str,
                      ports: list[tuple[str, int]]) -> dict[str, Any]:
    """Stable DNS names for the pods of `role` (clusterIP None), ready or not."""
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(config, name, role),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": _labels(config, role),
                 "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports]},
    }


def _resources(config: K8sConfig, role: str) -> dict[str, Any]:
    """Requests and limits of the pods of `role`; a worker's GPU is a limit (the device
    plugin's resources take no separate request)."""
    out: dict[str, Any] = {}
    for kind, names in (("requests", ("cpu", "memory")), ("limits", ("cpu_limit",
                                                                     "memory_limit"))):
        values = {name.split("_")[0]: str(value) for name in names
                  if (value := resource_setting(config, role, name)[1]) is not None}
        if kind == "limits" and role == "worker" and config.gpus:
            values[GPU_RESOURCE] = str(config.gpus)
        if values:
            out[kind] = values
    return out


def _placement(config: K8sConfig, role: str) -> dict[str, Any]:
    """The pod spec's nodeSelector and tolerations for `role`, when given."""
    out: dict[str, Any] = {}
    if node_selector(config, role):
        out["nodeSelector"] = node_selector(config, role)
    if tolerations(config, role):
        out["tolerations"] = tolerations(config, role)
    return out


def _env(pairs: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"name": k, "value": str(v)} for k, v in pairs.items()]


def worker_env(config: K8sConfig) -> dict[str, str]:
    """The worker container's environment. The run id is pinned to the job's name, so every
    attempt and every recreated pod finds the servers' checkpoints under resume/<run id>;
    PARALLAX_RESTART_COUNT is not here: the gang supervisor gives each attempt its own."""
    env = {
        RUN_ID_ENV: config.name,
        MODE_ENV: config.mode,
        SYNC_ENV: "sync" if config.sync else "async",
        JOB_CONFIG_ENV: f"{CONFIG_DIR}/{CONFIG_FILE}",
        CONNECT_TIMEOUT_ENV: f"{config.server_wait_s:g}",
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    if config.servers:
        env[ADDRESSES_ENV] = ",".join(ps_addresses(config))
    if config.replicas > 1:
        env[REPLICAS_ENV] = str(config.replicas)
    if config.replay_mb:
        env[REPLAY_ENV] = str(config.replay_mb)
    if config.workers > 1 and config.collectives == "tensorflow":
        env[WORKERS_ENV] = ",".join(collective_addresses(config))  # the rank: the bootstrap
    elif _horovod(config):
        env.update({
            RENDEZVOUS_ENV: rendezvous_address(config),
            "HOROVOD_SIZE": str(config.workers),  # (an elastic gang's supervisor sets its own)
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": config.gloo_iface,
        })
    if _gang(config):
        env[RENDEZVOUS_ENV] = rendezvous_address(config)  # worker 0 coordinates the gang
        env[WARM_STARTS_ENV] = config.warm_starts
    if config.max_restarts:
        env[MAX_RESTARTS_ENV] = str(config.max_restarts)
        if config.held_backups:
            env[HELD_BACKUPS_ENV] = str(config.held_backups)
    if elastic(config):
        least, most = worker_bounds(config)
        env.update({gang.MIN_WORKERS_ENV: str(least), gang.MAX_WORKERS_ENV: str(most),
                    gang.ELASTIC_TIMEOUT_ENV: f"{config.elastic_timeout:g}"})
    env.update(secure.worker_env(config))
    return env


def render(config: K8sConfig) -> list[dict[str, Any]]:
    """The job's Kubernetes objects, in the order to apply them."""
    validate(config)
    objects: list[dict[str, Any]] = [{
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(config, f"{config.name}-config", "config"),
        "data": {CONFIG_FILE: json.dumps(job_config(config), indent=2, sort_keys=True)},
    }]
    objects += secure.secret_objects(config)
    objects += secure.network_policies(config, server_metrics_port(config))
    objects += _jobset_objects(config) if config.format == "jobset" else _job_objects(config)
    for obj in objects:
        obj["metadata"]["namespace"] = config.namespace
    objects = json.loads(json.dumps(objects))  # no shared sub-objects (no YAML anchors)
    return k8s_patch.apply(objects, k8s_patch.from_files(config.patches))


def _job_objects(config: K8sConfig) -> list[dict[str, Any]]:
    """--format job: the servers' StatefulSet (and its watcher's rights), the worker Job,
    and a headless Service for each."""
    objects: list[dict[str, Any]] = []
    if config.servers:
        ports = [("grpc", config.server_port)]
        if server_metrics_port(config):
            ports.append(("metrics", server_metrics_port(config)))
        objects += [] if config.keep_servers else _watcher_access(config)
        objects += [_headless_service(config, f"{config.name}-ps", "ps", ports),
                    _server_set(config)]
        objects += [_service_monitor(config)] if config.service_monitor else []
    return objects + [_headless_service(config, f"{config.name}-workers", "worker",
                                        worker_ports(config) or [("rendezvous",
                                                                  config.rendezvous_port)]),
                      _worker_job(config)]


def _jobset_objects(config: K8sConfig) -> list[dict[str, Any]]:
    """--format jobset: one JobSet holding the servers' Job and the workers' Job."""
    specs = {"ps": _server_job_spec(config)} if config.servers else {}
    specs["worker"] = _worker_spec(config)
    return [k8s_jobset.jobset(config, specs, _meta(config, config.name, "jobset"))]


def _server_container(config: K8sConfig) -> dict[str, Any]:
    probe = {**secure.server_probe(config), "periodSeconds": 5, "failureThreshold": 3}
    data_dir = server_data_dir(config)
    metrics = server_metrics_port(config)
    server = {
        "name": "server", "image": config.image, "imagePullPolicy": config.image_pull_policy,
        "command": ["parallax", "server", "--host", "0.0.0.0", "--port",
                    str(config.server_port), *config.server_args, *secure.server_args(config),
                    "--data-port", str(config.server_port + 1),  # the data plane
                    *(["--metrics-host", "0.0.0.0", "--metrics-port", str(metrics)]
                      if metrics else []),
                    *(["--data-dir", data_dir] if data_dir else []),
                    *_restore_args(config)],
        "ports": [{"name": "grpc", "containerPort": config.server_port},
                  {"name": "data", "containerPort": config.server_port + 1},
                  *([{"name": "metrics", "containerPort": metrics}] if metrics else [])],
        "readinessProbe": dict(probe, initialDelaySeconds=2),
        "livenessProbe": dict(probe, initialDelaySeconds=10, periodSeconds=10),
    }
    if config.replay_mb:
        server["env"] = [{"name": POD_UID_ENV,
                          "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]
    if data_dir:
        server["volumeMounts"] = [{"name": "data", "mountPath": data_dir}]
    if _resources(config, "ps"):
        server["resources"] = _resources(config, "ps")
    return server


POD_UID_ENV = "PARALLAX_POD_UID"  # the server container's pod's uid (the downward API)


def _restore_args(config: K8sConfig) -> list[str]:
    """With --replay-mb: the server restores each shard from its newest checkpoint when its
    container starts again in the same pod (the pod's uid, the same across its container's
    restarts), never on a pod's first start (parallax_ps.instance)."""
    if not config.replay_mb:
        return []
    return ["--restore-newest-on-restart", f"$({POD_UID_ENV})"]  # (the kubelet expands it)


def _data_claim(config: K8sConfig) -> dict[str, Any]:
    """volumeClaimTemplates entry: one PersistentVolumeClaim per server pod, data-JOB-ps-<i>,
    kept when pods restart or move (and when the StatefulSet is deleted: Retain)."""
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": str(config.data_volume_size)}}}
    if config.storage_class:
        spec["storageClassName"] = config.storage_class
    return {"metadata": {"name": "data", "labels": _labels(config, "ps")}, "spec": spec}


def _server_template(config: K8sConfig, restart_policy: str) -> dict[str, Any]:
    """The server pods' template: restartPolicy Always in a StatefulSet, OnFailure in a
    JobSet's Job; the data dir on an emptyDir (survives container restarts, not a pod's move
    to another node) unless a claim per pod is mounted there (--data-volume-size); with
    --format job, the job watcher beside the server (not with --keep-servers)."""
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": 30, "restartPolicy": restart_policy,
                           "containers": [_server_container(config)], "volumes": [],
                           **_placement(config, "ps")}
    if config.format == "jobset":
        pod["subdomain"] = subdomain(config, "ps")
    annotations = {"kubectl.kubernetes.io/default-container": "server"}
    if server_metrics_port(config) and config.insecure:  # a Prometheus that finds pods by
        # annotation sends no token: a secure job's metrics are scraped by ServiceMonitor
        annotations.update({"prometheus.io/scrape": "true", "prometheus.io/path": "/metrics",
                            "prometheus.io/port": str(server_metrics_port(config))})
    if server_data_dir(config):
        pod["securityContext"] = {"fsGroup": IMAGE_UID, "fsGroupChangePolicy": "OnRootMismatch"}
        if not config.data_volume_size:
            pod["volumes"].append({"name": "data", "emptyDir": {}})
    if config.format == "job" and not config.keep_servers:
        _add_watcher(config, pod)
    elif config.format == "jobset" and not config.insecure:
        pod["automountServiceAccountToken"] = False  # no watcher: no API access at all
    secure.mount_credentials(config, pod, pod["containers"][0], "server")
    secure.restrict(config, pod)
    if not pod["volumes"]:
        del pod["volumes"]
    return {"metadata": {"labels": _labels(config, "ps"), "annotations": annotations},
            "spec": pod}


def _server_set(config: K8sConfig) -> dict[str, Any]:
    """The servers: a StatefulSet (stable names; pods restart by themselves, restartPolicy
    Always) whose data dir is a PersistentVolumeClaim per pod (--data-volume-size), kept when
    the watcher deletes the StatefulSet, or an emptyDir."""
    ps_labels = _labels(config, "ps")
    spec: dict[str, Any] = {
        "serviceName": f"{config.name}-ps", "replicas": config.servers,
        "podManagementPolicy": "Parallel", "selector": {"matchLabels": ps_labels},
        "template": _server_template(config, "Always"),
    }
    if server_data_dir(config) and config.data_volume_size:
        spec["volumeClaimTemplates"] = [_data_claim(config)]
        spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Retain",
                                                        "whenScaled": "Retain"}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": _meta(config, f"{config.name}-ps", "ps"), "spec": spec}


# --format jobset: in-place restarts a server's Job allows per server before it fails (a
# StatefulSet's pods, --format job, restart without limit; one OOM kill must not end a job
# rendered with the default --max-restarts 0)
SERVER_RESTARTS = 10


def _server_job_spec(config: K8sConfig) -> dict[str, Any]:
    """The servers in a JobSet: an indexed Job of S pods (stable names from the JobSet's
    Service). A server container that fails restarts in place (restartPolicy OnFailure, its
    emptyDir kept), as a StatefulSet's would, up to SERVER_RESTARTS times a server
    (backoffLimit, at least --max-restarts; only a crash loop uses them up); after that the
    Job fails and the JobSet's failurePolicy decides. They never complete by themselves: the
    JobSet deletes them once the workers have completed (its successPolicy) or it failed."""
    backoff = max(config.max_restarts, SERVER_RESTARTS * config.servers)
    return {"completionMode": "Indexed", "completions": config.servers,
            "parallelism": config.servers, "backoffLimit": backoff,
            "template": _server_template(config, "OnFailure")}


def _add_watcher(config: K8sConfig, pod: dict[str, Any]) -> None:
    """The server pod's `parallax k8s watch-job` container, and the API token only it
    mounts (the pod's automatic token is off: the server container gets no credentials)."""
    pod["serviceAccountName"] = f"{config.name}-ps"
    pod["automountServiceAccountToken"] = False
    pod["containers"].append({
        "name": "job-watch", "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["parallax", "k8s", "watch-job", "--namespace", config.namespace,
                    "--job", f"{config.name}-worker", "--servers", f"{config.name}-ps"],
        "env": _env({"PYTHONUNBUFFERED": "1"}),
        "resources": WATCHER,
        "volumeMounts": [{"name": "api-token", "mountPath": SERVICE_ACCOUNT_DIR,
                          "readOnly": True}],
    })
    pod["volumes"].append({"name": "api-token", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt",
                                                              "path": "ca.crt"}]}},
    ]}})


def _watcher_access(config: K8sConfig) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding JOB-ps: the watcher may read the worker Job and
    delete the servers' StatefulSet, by name, and nothing else."""
    name, rbac = f"{config.name}-ps", "rbac.authorization.k8s.io"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(config, name, "ps"),
         "automountServiceAccountToken": False},
        {"apiVersion": f"{rbac}/v1", "kind": "Role", "metadata": _meta(config, name, "ps"),
         "rules": [{"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get"],
                    "resourceNames": [f"{config.name}-worker"]},
                   {"apiGroups": ["apps"], "resources": ["statefulsets"],
                    "verbs": ["delete"], "resourceNames": [name]}]},
        {"apiVersion": f"{rbac}/v1", "kind": "RoleBinding",
         "metadata": _meta(config, name, "ps"),
         "subjects": [{"kind": "ServiceAccount", "name": name,
                       "namespace": config.namespace}],
         "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name}},
    ]


def _service_monitor(config: K8sConfig) -> dict[str, Any]:
    """The Prometheus Operator's ServiceMonitor for the servers' Service, port "metrics";
    --service-monitor-label adds the labels its Prometheus selects ServiceMonitors by."""
    meta = _meta(config, f"{config.name}-ps", "ps")
    meta["labels"] = {**dict(parse_selector(t, "--service-monitor-label")
                             for t in config.service_monitor_labels), **meta["labels"]}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": meta,
            "spec": {"selector": {"matchLabels": _labels(config, "ps")},
                     "namespaceSelector": {"matchNames": [config.namespace]},
                     "endpoints": [{"port": "metrics", "path": "/metrics",
                                    "interval": "30s", **secure.scrape_auth(config)}]}}


def _worker_job(config: K8sConfig) -> dict[str, Any]:
    """The workers: an indexed Job, one pod per rank, each running `parallax k8s worker`
    (_worker_spec)."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _meta(config, f"{config.name}-worker", "worker"),
            "spec": _worker_spec(config)}


def _worker_spec(config: K8sConfig) -> dict[str, Any]:
    """The workers' indexed Job spec. Without restarts one failed rank fails the Job
    (backoffLimit 0: Horovod cannot re-admit a rank). With --max-restarts N the pods restart
    their commands together, in place (parallax.launch.gang); with --format job the Job's
    backoff recreates the pods when that gang lost worker 0 or a pod was disrupted (see
    _failure_policy), with --format jobset such a Job fails (backoffLimit 0) and the JobSet
    restarts as a whole (k8s_jobset)."""
    worker = {
        "name": "worker", "image": config.image, "imagePullPolicy": config.image_pull_policy,
        "command": ["parallax", "k8s", "worker", "--", *config.command],
        "env": _env(worker_env(config)),
        "volumeMounts": [{"name": "job-config", "mountPath": CONFIG_DIR, "readOnly": True}],
    }
    ports = worker_ports(config)
    if ports:
        worker["ports"] = [{"name": n, "containerPort": p} for n, p in ports]
    if _resources(config, "worker"):
        worker["resources"] = _resources(config, "worker")
    backoff = 0 if config.format == "jobset" else \
        config.max_restarts * worker_bounds(config)[1]  # (N gangs of the most pods)
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": config.workers, "parallelism": config.workers,
        "backoffLimit": backoff,
        "template": {
            "metadata": {"labels": _labels(config, "worker")},
            "spec": {"subdomain": subdomain(config, "worker"), "restartPolicy": "Never",
                     "containers": [worker],
                     "volumes": [{"name": "job-config",
                                  "configMap": {"name": f"{config.name}-config"}}],
                     **_placement(config, "worker")},
        },
    }
    pod = spec["template"]["spec"]
    if not config.insecure:
        pod["automountServiceAccountToken"] = False  # workers need no API access
    secure.mount_credentials(config, pod, worker, "client")
    secure.restrict(config, pod)
    if _gang(config):
        spec["podFailurePolicy"] = _failure_policy()
    return spec


def worker_ports(config: K8sConfig) -> list[tuple[str, int]]:
    """The worker pods' ports: the rendezvous on worker 0 (a Horovod job, or the gang of
    --max-restarts), each worker's TensorFlow server (--collectives tensorflow)."""
    ports = []
    if _horovod(config) or _gang(config):
        ports.append(("rendezvous", config.rendezvous_port))
    if config.workers > 1 and config.collectives == "tensorflow":
        ports.append(("collective", config.collective_port))
    return ports


def _failure_policy() -> dict[str, Any]:
    """Which failed worker pods the Job recreates (counted against backoffLimit = N x
    workers: N whole gangs): disrupted ones (eviction, preemption, node loss) and those that
    lost worker 0 (exit LOST_GANG_EXIT). Any other exit means the gang already restarted in
    place N times, or cannot start: the Job fails at once instead of starting over."""
    return {"rules": [
        {"action": "Count",
         "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": "worker", "operator": "NotIn",
                                              "values": [gang.LOST_GANG_EXIT]}},
    ]}


class _Dumper(yaml.SafeDumper):
    """safe_dump, with multi-line strings (job.json) as literal block scalars ("|")."""


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def dump(objects: list[dict[str, Any]], note: str | None = None) -> str:
    """The objects as one YAML stream; `note`, if any, as a comment at its top."""
    text = yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    return f"# {note}\n{text}" if note else text
