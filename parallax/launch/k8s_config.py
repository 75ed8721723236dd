"""`parallax k8s`'s job settings: `K8sConfig`, what it may hold (`validate`: a ConfigError
naming the first bad field and its fix), and the values derived from it that validation and
rendering share (a role's resources, node selector and tolerations, the metrics port).
The manifests themselves: parallax.launch.k8s_render."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Mapping

from parallax.client.replicas import check_flag
from parallax.env import PLAN_KEYS, RUN_MODES
from parallax.errors import ConfigError
from parallax.launch import k8s_security as secure
from parallax.launch.gang import ELASTIC_TIMEOUT_S
from parallax.launch.k8s_labels import _SUBDOMAIN, key_problem, parse_selector, value_problem
from parallax.launch.warm import WARM_STARTS

CONFIG_DIR = "/etc/parallax"
CONFIG_FILE = "job.json"
MAX_NAME = 40  # leaves room for "-worker-<index>" and StatefulSet revision hashes (63 max)
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_IFACE = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
DEFAULT_DATA_DIR = "/var/lib/parallax"  # the servers' data dir when restarts need one
IMAGE_UID = secure.IMAGE_UID            # the Dockerfile's USER: owns the data volume
GPU_RESOURCE = "nvidia.com/gpu"         # the NVIDIA device plugin's extended resource
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_SUFFIXES = {"": 1, "m": Decimal("0.001"), "k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9,
             "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18, "Ki": 2 ** 10, "Mi": 2 ** 20,
             "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60}
K8S_COLLECTIVES = ("horovod", "tensorflow")  # no "auto": the image decides, not this machine
# --format: "job" (a StatefulSet and an indexed Job, no controller beyond a stock cluster's)
# or "jobset" (one JobSet, for clusters running the JobSet controller, MIN_JOBSET or newer)
FORMATS = ("job", "jobset")
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
MIN_JOBSET = "v0.8.0"  # dependsOn (v0.8.0), failurePolicy.restartStrategy (v0.7.0), rules (v0.6.0)


MIN_KUBERNETES = "1.29"  # the oldest release whose schemas the rendered objects pass (CI)
SERVER_WAIT_S = 600.0    # a server pod may wait for its volume or pull a large image first


@dataclass(frozen=True)
class K8sConfig:
    name: str                             # job name: a DNS-1123 label, also the run id
    image: str                            # an image built from this repository's Dockerfile
    command: tuple[str, ...]              # the training program, e.g. ("python", "train.py")
    workers: int = 1                      # the worker pods the Job starts with (-np)
    min_workers: int | None = None        # --min-np: an elastic Job's fewest (default workers)
    max_workers: int | None = None        # --max-np: its most (default workers)
    elastic_timeout: float = ELASTIC_TIMEOUT_S  # seconds worker 0 waits for --min-np pods
    servers: int = 2                      # 0 only with mode="allreduce"
    namespace: str = "default"
    cluster_domain: str = "cluster.local"  # the cluster's DNS domain (kubelet --cluster-domain)
    server_wait_s: float = SERVER_WAIT_S  # how long workers give the servers to come up
    mode: str = "hybrid"                  # hybrid | ps | allreduce
    sync: bool = True
    replicas: int = 1                     # 2: a copy of each shard on the next server pod
    replay_mb: int = 0                    # N: each worker keeps N MiB of its pushes, replayed
                                          # to a server container restarted in its pod
    server_port: int = 7000
    rendezvous_port: int = 7070           # Horovod gloo rendezvous, served by worker 0
    collectives: str = "horovod"          # horovod | tensorflow: the workers' dense sums
    collective_port: int = 7080           # each worker's TensorFlow server (tensorflow)
    cpu: str | None = None                # resource requests of every pod, e.g. "2", "500m"
    memory: str | None = None             # e.g. "4Gi"
    plan: Mapping[str, Any] = field(default_factory=dict)  # placement / shards / local_aggregation
    server_args: tuple[str, ...] = ()     # extra `parallax server` arguments
    gloo_iface: str = "eth0"              # the pod network interface gloo binds to
    image_pull_policy: str = "IfNotPresent"
    max_restarts: int = 0                 # gang restarts of all workers after a failure
    warm_starts: str = "auto"             # each restart's command forked warm in its pod
    held_backups: int = 0                 # with max_restarts: one Keras backup in N on disk,
                                          # the others held by the servers, which keep the
                                          # run's tables across restarts
    data_dir: str | None = None           # the servers' --data-dir (checkpoints)
    data_volume_size: str | None = None   # a PersistentVolumeClaim per server, e.g. "10Gi"
    storage_class: str | None = None      # its storageClassName (None: the cluster default)
    keep_servers: bool = False            # no watcher: the servers outlive the Job
    metrics_port: int | None = None       # servers' /metrics (None: server_port + 2; 0: off)
    service_monitor: bool = False         # a monitoring.coreos.com/v1 ServiceMonitor
    service_monitor_labels: tuple[str, ...] = ()  # "KEY=VALUE": what Prometheus selects on
    cpu_limit: str | None = None          # resource limits of every pod
    memory_limit: str | None = None
    server_cpu: str | None = None         # the servers' own requests and limits (default:
    server_memory: str | None = None      # cpu, memory and their limits above)
    server_cpu_limit: str | None = None
    server_memory_limit: str | None = None
    gpus: int = 0                         # nvidia.com/gpu limit of each worker pod (0 or 1)
    worker_node_selector: tuple[str, ...] = ()  # "KEY=VALUE" node labels the pods need
    server_node_selector: tuple[str, ...] = ()
    worker_tolerations: tuple[str, ...] = ()    # "KEY=VALUE[:EFFECT]" or "KEY[:EFFECT]"
    server_tolerations: tuple[str, ...] = ()
    insecure: bool = False                # today's open shape: no token, TLS or NetworkPolicy
    token_secret: str | None = None       # an existing Secret (key "token") instead of a new one
    secure: bool = False                  # mutual TLS too (certificates made at render time)
    metrics_namespaces: tuple[str, ...] = ()  # namespaces whose pods may scrape /metrics
    metrics_pod_labels: tuple[str, ...] = ()  # "KEY=VALUE": pods here that may scrape it
    patches: tuple[str, ...] = ()         # YAML files merged into the objects (k8s_patch)
    format: str = "job"                   # job | jobset: the workload's shape (FORMATS)


def _domain(value: str) -> None:
    labels = value.split(".") if isinstance(value, str) else [None]
    if not value or len(value) > 253 or not all(isinstance(v, str) and len(v) <= 63 and
                                                _DNS_LABEL.match(v) for v in labels):
        raise ConfigError(f"--cluster-domain {value!r} is not a DNS domain (labels of "
                          f"lower-case letters, digits and '-', joined by '.'); e.g. "
                          f"--cluster-domain cluster.local")


def _label(value: str, what: str, fix: str) -> None:
    if not isinstance(value, str) or len(value) > 63 or not _DNS_LABEL.match(value):
        raise ConfigError(f"{what} {value!r} is not a DNS-1123 label (lower-case letters, "
                          f"digits and '-', starting and ending with a letter or digit, at "
                          f"most 63 characters); {fix}")


def validate(config: K8sConfig) -> None:
    """Raise ConfigError naming the first bad field and the fix."""
    if config.format not in FORMATS:
        raise ConfigError(f"--format {config.format!r} must be one of {', '.join(FORMATS)} "
                          f"(job: the default, any cluster; jobset: a cluster running the "
                          f"JobSet controller {MIN_JOBSET} or newer)")
    _label(config.name, "--name", "e.g. --name wordlm-1")
    if len(config.name) > MAX_NAME:
        raise ConfigError(f"--name {config.name!r} has {len(config.name)} characters; at most "
                          f"{MAX_NAME} (pod names add '-worker-<index>'): shorten it")
    _label(config.namespace, "--namespace", "e.g. --namespace default")
    _domain(config.cluster_domain)
    if not isinstance(config.server_wait_s, (int, float)) or not \
            1 <= config.server_wait_s <= 86400:
        raise ConfigError(f"--server-wait {config.server_wait_s!r} must be seconds in 1-86400 "
                          f"(default {SERVER_WAIT_S:g}: time for a volume and an image pull)")
    if not isinstance(config.image, str) or not config.image or any(c.isspace()
                                                                  for c in config.image):
        raise ConfigError(f"--image {config.image!r} must be an image reference without "
                          f"spaces, e.g. registry.example.com/parallax:0.1")
    for name in ("command", "server_args", "worker_node_selector", "server_node_selector",
                 "worker_tolerations", "server_tolerations", "service_monitor_labels",
                 "metrics_namespaces", "metrics_pod_labels", "patches"):
        value = getattr(config, name)
        if isinstance(value, str) or not all(isinstance(a, str) for a in value):
            raise ConfigError(f"{name} must be a tuple of strings, not {value!r}")
    if not config.command or not config.command[0]:
        raise ConfigError("no command to run: give the training program after '--', e.g. "
                          "`parallax k8s --name job --image img -- python train.py`")
    if not isinstance(config.workers, int) or config.workers < 1:
        raise ConfigError(f"--workers {config.workers!r}: the number of worker pods must be "
                          f"at least 1")
    if config.mode not in RUN_MODES:
        raise ConfigError(f"--mode {config.mode!r} is not one of {', '.join(RUN_MODES)}")
    if not isinstance(config.servers, int) or config.servers < 0:
        raise ConfigError(f"--servers {config.servers!r} must be >= 0")
    if config.servers == 0 and config.mode != "allreduce":
        raise ConfigError(f"--servers 0 with --mode {config.mode}: the plan puts variables on "
                          f"parameter servers; give --servers 1 or more, or --mode allreduce")
    check_flag(config.replicas, config.servers, config.sync)
    if config.collectives not in K8S_COLLECTIVES:
        raise ConfigError(f"--collectives {config.collectives!r} must be one of "
                          f"{', '.join(K8S_COLLECTIVES)} (the image decides: horovod needs an "
                          f"image with Horovod, the Dockerfile's default)")
    for flag, port in (("--server-port", config.server_port),
                       ("--rendezvous-port", config.rendezvous_port),
                       ("--collective-port", config.collective_port)):
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ConfigError(f"{flag} {port!r} must be a port in 1-65535")
    if config.collectives == "tensorflow" and config.collective_port in (
            config.server_port, config.server_port + 1, config.rendezvous_port):
        raise ConfigError(f"--collective-port {config.collective_port} is already a server "
                          f"or rendezvous port; give another")
    if config.server_port == 65535:
        raise ConfigError("--server-port 65535 leaves no port after it for the servers' data "
                          "plane (--server-port + 1); give 1-65534")
    if config.rendezvous_port in (config.server_port, config.server_port + 1):
        raise ConfigError(f"--rendezvous-port {config.rendezvous_port} is a server port "
                          f"(--server-port {config.server_port} and the data plane on the "
                          f"port after it); give another")
    if not _IFACE.match(config.gloo_iface):
        raise ConfigError(f"--gloo-iface {config.gloo_iface!r} is not a network interface "
                          f"name; the pod interface is usually eth0")
    if config.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
        raise ConfigError(f"--image-pull-policy {config.image_pull_policy!r} must be Always, "
                          f"IfNotPresent or Never")
    for arg in config.server_args:
        if arg.split("=", 1)[0] in ("--port", "--host", "--data-port"):
            raise ConfigError(f"--server-arg {arg!r}: host and ports are set by the manifests "
                              f"(--server-port, and the data plane on the port after it); "
                              f"drop it")
        if arg.split("=", 1)[0] in ("--metrics-port", "--metrics-host"):
            raise ConfigError(f"--server-arg {arg!r}: the metrics endpoint is set by the "
                              f"manifests; give --metrics-port instead")
        if arg.split("=", 1)[0] == "--data-dir":
            raise ConfigError(f"--server-arg {arg!r}: the servers' data directory is "
                              f"--data-dir (mounted on its volume); give that instead")
        if arg.split("=", 1)[0] in RESTORE_ARGS:
            raise ConfigError(f"--server-arg {arg!r}: a server pod runs the same command on "
                              f"every start, so it would restore on its first start too, "
                              f"maybe from an earlier run's checkpoints on its volume; give "
                              f"--replay-mb N (restores on a container's restart only)")
    _validate_security(config)
    _validate_resources(config)
    _validate_scheduling(config)
    _validate_metrics(config)
    _validate_scrapers(config)
    _validate_restarts(config)
    _validate_replay(config)
    _validate_elastic(config)
    _validate_plan(config.plan)
    _validate_jobset(config)
    if config.collectives == "tensorflow" and config.plan.get("local_aggregation"):
        raise ConfigError("--plan local_aggregation with --collectives tensorflow: local "
                          "aggregation gathers gradients through Horovod; drop one of them")


RESTORE_ARGS = ("--restore-newest", "--restore-newest-on-restart")  # set by --replay-mb
SECURITY_ARGS = ("--token-file", "--tls-cert", "--tls-key", "--tls-client-ca",
                 "--health-without-token")


def _validate_security(config: K8sConfig) -> None:
    opened = [flag for flag, given in (
        ("--secure", config.secure), ("--token-secret", config.token_secret),
        ("--metrics-namespace", config.metrics_namespaces),
        ("--metrics-pod-label", config.metrics_pod_labels)) if given]
    if config.insecure and opened:
        raise ConfigError(f"--insecure renders no token, TLS or NetworkPolicy, and {opened[0]} "
                          f"configures them: drop one of the two")
    if config.token_secret is not None and (len(config.token_secret) > 253 or not
                                            _SUBDOMAIN.match(config.token_secret)):
        raise ConfigError(f"--token-secret {config.token_secret!r} is not a Secret name (a "
                          f"lower-case DNS name), e.g. --token-secret parallax-token")
    if config.secure and not config.servers:
        raise ConfigError("--secure makes TLS certificates for the parameter servers, and "
                          "--servers is 0: drop --secure (the token still guards the gang)")
    for ns in config.metrics_namespaces:
        _label(ns, "--metrics-namespace", "e.g. --metrics-namespace monitoring")
    for text in config.metrics_pod_labels:
        parse_selector(text, "--metrics-pod-label")
    for arg in config.server_args:
        if not config.insecure and arg.split("=", 1)[0] in SECURITY_ARGS:
            raise ConfigError(f"--server-arg {arg!r}: the manifests set the servers' token "
                              f"and TLS (--token-secret, --secure); drop it")


def _validate_scrapers(config: K8sConfig) -> None:
    """Who may scrape the servers' metrics: named where there is something to scrape, and
    named when a ServiceMonitor must reach it through the job's NetworkPolicy."""
    named = config.metrics_namespaces or config.metrics_pod_labels
    if named and not (config.servers and server_metrics_port(config)):
        raise ConfigError("--metrics-namespace/--metrics-pod-label admit scrapes of the "
                          "servers' metrics port, and " + ("--servers is 0" if not
                                                           config.servers else
                                                           "--metrics-port is 0")
                          + ": drop them, or give servers a metrics port")
    if config.service_monitor and not config.insecure and not named:
        raise ConfigError("--service-monitor: the job's NetworkPolicy admits only the job's "
                          "own pods, so Prometheus could not scrape; say where it runs: "
                          "--metrics-namespace NS (e.g. monitoring) or --metrics-pod-label "
                          "KEY=VALUE (a Prometheus in the job's namespace)")


# Resources: "--cpu" and friends for every pod, "--server-cpu" and friends for the servers.
RESOURCE_FIELDS = ("cpu", "memory", "cpu_limit", "memory_limit")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resource_setting(config: K8sConfig, role: str, name: str) -> tuple[str, str | None]:
    """(flag, value) of resource field `name` (cpu, memory, cpu_limit, memory_limit) for the
    pods of `role` ("worker" or "ps"): the servers' own --server-... when given."""
    own = getattr(config, f"server_{name}") if role == "ps" else None
    if own is not None:
        return _flag(f"server_{name}"), own
    return _flag(name), getattr(config, name)


def _amount(quantity: str) -> Decimal:
    """A Kubernetes quantity (already matched by _QUANTITY) as a number: 500m -> 0.5."""
    suffix = _QUANTITY.match(quantity).group(2) or ""
    return Decimal(quantity[:len(quantity) - len(suffix)]) * _SUFFIXES[suffix]


def _validate_resources(config: K8sConfig) -> None:
    for name in RESOURCE_FIELDS + tuple(f"server_{n}" for n in RESOURCE_FIELDS):
        value = getattr(config, name)
        if value is not None and not _QUANTITY.match(str(value)):
            raise ConfigError(f"{_flag(name)} {value!r} is not a Kubernetes quantity; e.g. "
                              f"--cpu 2, --cpu 500m, --memory 4Gi")
    for role, pods in (("worker", "worker"), ("ps", "server")):
        for what in ("cpu", "memory"):
            request_flag, request = resource_setting(config, role, what)
            limit_flag, limit = resource_setting(config, role, f"{what}_limit")
            if request is not None and limit is not None \
                    and _amount(str(request)) > _amount(str(limit)):
                raise ConfigError(f"{request_flag} {request} is more than {limit_flag} {limit} "
                                  f"(the {pods} pods' {what}): a request cannot exceed its "
                                  f"limit; raise {limit_flag} or lower {request_flag}")
    if isinstance(config.gpus, bool) or config.gpus not in (0, 1):
        raise ConfigError(f"--gpus {config.gpus!r}: each worker pod is one Horovod rank (a "
                          f"host with one slot), which trains on one GPU; give --gpus 1 and "
                          f"one worker pod per GPU (--workers), or --gpus 0")


# Scheduling: nodeSelector and tolerations, per role.

def parse_toleration(text: str, flag: str) -> dict[str, str]:
    """"KEY=VALUE[:EFFECT]" (operator Equal) or "KEY[:EFFECT]" (operator Exists: any value)
    as a toleration; without an effect it tolerates every effect of the taint."""
    rest, colon, effect = text.partition(":")
    key, equals, value = rest.partition("=")
    problem = key_problem(key) or (value_problem(value) if equals else None)
    if colon and effect not in EFFECTS:
        problem = f"the effect {effect!r} is not one of {', '.join(EFFECTS)}"
    if problem:
        raise ConfigError(f"{flag} {text!r}: {problem}; the form is KEY=VALUE[:EFFECT] or "
                          f"KEY[:EFFECT] (any value), effect {', '.join(EFFECTS[:-1])} or "
                          f"{EFFECTS[-1]}, e.g. {flag} {GPU_RESOURCE}=present:NoSchedule")
    toleration = {"key": key, "operator": "Equal" if equals else "Exists"}
    if equals:
        toleration["value"] = value
    if colon:
        toleration["effect"] = effect
    return toleration


def node_selector(config: K8sConfig, role: str) -> dict[str, str]:
    texts = config.server_node_selector if role == "ps" else config.worker_node_selector
    return dict(parse_selector(t, f"--{'server' if role == 'ps' else 'worker'}-node-selector")
                for t in texts)


def tolerations(config: K8sConfig, role: str) -> list[dict[str, str]]:
    texts = config.server_tolerations if role == "ps" else config.worker_tolerations
    return [parse_toleration(t, f"--{'server' if role == 'ps' else 'worker'}-toleration")
            for t in texts]


def _validate_scheduling(config: K8sConfig) -> None:
    for role in ("worker", "ps"):
        node_selector(config, role)
        tolerations(config, role)


# Metrics: the servers' Prometheus endpoint, and the Prometheus Operator's ServiceMonitor.

def server_metrics_port(config: K8sConfig) -> int | None:
    """The port of the servers' /metrics: --metrics-port, by default the one after the data
    plane (--server-port + 2); None with --metrics-port 0."""
    port = config.server_port + 2 if config.metrics_port is None else config.metrics_port
    return port or None


def _validate_metrics(config: K8sConfig) -> None:
    port = config.metrics_port
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 0 <= port < 65536):
        raise ConfigError(f"--metrics-port {port!r} must be a port in 1-65535, or 0 for no "
                          f"metrics endpoint")
    if config.servers and port is None and config.server_port + 2 > 65535:
        raise ConfigError(f"--server-port {config.server_port} leaves no port for the "
                          f"servers' metrics (--server-port + 2); give --metrics-port P, or 0")
    if port in (config.server_port, config.server_port + 1):
        raise ConfigError(f"--metrics-port {port} is a server port (--server-port "
                          f"{config.server_port} and the data plane on the port after it); "
                          f"give another")
    labels = [parse_selector(t, "--service-monitor-label")
              for t in config.service_monitor_labels]
    if labels and not config.service_monitor:
        raise ConfigError("--service-monitor-label labels the ServiceMonitor: give "
                          "--service-monitor too")
    if config.service_monitor and not (config.servers and server_metrics_port(config)):
        raise ConfigError("--service-monitor scrapes the parameter servers' metrics, and "
                          + ("--servers is 0" if not config.servers else "--metrics-port is 0")
                          + ": drop it, or give servers a metrics port")


def _validate_restarts(config: K8sConfig) -> None:
    if isinstance(config.max_restarts, bool) or not isinstance(config.max_restarts, int) \
            or config.max_restarts < 0:
        raise ConfigError(f"--max-restarts {config.max_restarts!r} must be an integer >= 0 "
                          f"(0: a failure ends the job)")
    if config.warm_starts not in WARM_STARTS:
        raise ConfigError(f"--warm-starts {config.warm_starts!r}: give one of "
                          f"{', '.join(WARM_STARTS)}")
    if isinstance(config.held_backups, bool) or not isinstance(config.held_backups, int) \
            or config.held_backups < 0:
        raise ConfigError(f"--held-backups {config.held_backups!r} must be an integer >= 0 "
                          f"(N: one backup in N on disk, the others held by the servers)")
    if config.data_volume_size is not None and not _QUANTITY.match(str(config.data_volume_size)):
        raise ConfigError(f"--data-volume-size {config.data_volume_size!r} is not a Kubernetes "
                          f"quantity; e.g. --data-volume-size 10Gi")
    if config.storage_class is not None and (config.data_volume_size is None or not
                                             _SUBDOMAIN.match(config.storage_class)):
        raise ConfigError(f"--storage-class {config.storage_class!r} needs --data-volume-size "
                          f"and a lower-case DNS name, e.g. --data-volume-size 10Gi "
                          f"--storage-class standard-rwo")
    if config.data_dir is not None and (not config.data_dir.startswith("/")
                                        or any(c.isspace() for c in config.data_dir)):
        raise ConfigError(f"--data-dir {config.data_dir!r} must be an absolute path without "
                          f"spaces, e.g. --data-dir {DEFAULT_DATA_DIR}")
    if config.servers == 0 and (config.data_dir or config.data_volume_size):
        raise ConfigError("--data-dir and --data-volume-size are for the parameter servers, "
                          "and --servers is 0: drop them or give --servers 1 or more")


def _validate_replay(config: K8sConfig) -> None:
    """--replay-mb N: a server container restarted in its pod restores its newest checkpoint
    and the workers replay their pushes since, exactly only where sync steps sum them in a
    fixed order on one copy of each shard (as `parallax run --replay-mb`)."""
    n = config.replay_mb
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"--replay-mb {n!r} must be an integer >= 0 (MiB of pushes each "
                          f"worker keeps to replay to a server started again; 0: off)")
    if n == 0:
        return
    if config.servers == 0:
        raise ConfigError(f"--replay-mb {n} with --servers 0: there is no parameter server "
                          f"to replay to; drop --replay-mb, or give --servers 1 or more")
    if config.replicas > 1:
        raise ConfigError(f"--replay-mb {n} with --replicas {config.replicas}: give one (copies "
                          f"of each shard, or a lost server started again from its checkpoint "
                          f"and the pushes since replayed to it)")
    if not config.sync:
        raise ConfigError(f"--replay-mb {n} with --async: a replay rebuilds a shard exactly "
                          f"only from sync steps (the workers' pushes summed in a fixed "
                          f"order); drop one of them")


def worker_bounds(config: K8sConfig) -> tuple[int, int]:
    """(--min-np, --max-np): the fewest and most worker pods the Job may be scaled between,
    each --workers unless given."""
    return tuple(config.workers if value is None else value
                 for value in (config.min_workers, config.max_workers))


def elastic(config: K8sConfig) -> bool:
    """Whether the worker Job may be scaled (`kubectl patch` of completions and parallelism):
    its gang then follows the pods there (parallax.launch.gang.Scaling)."""
    return worker_bounds(config) != (config.workers, config.workers)


def _validate_elastic(config: K8sConfig) -> None:
    for flag, value in (("--min-np", config.min_workers), ("--max-np", config.max_workers)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{flag} {value!r} must be an integer (a worker count)")
    least, most = worker_bounds(config)
    if not 1 <= least <= config.workers <= most:
        raise ConfigError(f"--min-np {least}, --workers {config.workers}, --max-np {most}: "
                          f"need 1 <= --min-np <= --workers <= --max-np (the Job starts with "
                          f"--workers pods; each bound defaults to it)")
    if isinstance(config.elastic_timeout, bool) or not isinstance(
            config.elastic_timeout, (int, float)) or not 0 < config.elastic_timeout <= 86400:
        raise ConfigError(f"--elastic-timeout {config.elastic_timeout!r} must be seconds in "
                          f"(0, 86400] (default {ELASTIC_TIMEOUT_S:g})")
    if not elastic(config):
        return
    if config.collectives == "tensorflow":
        raise ConfigError(f"--min-np {least} / --max-np {most} with --collectives tensorflow: "
                          f"TensorFlow's collectives take every worker's address from the pod "
                          f"template, which a scaled Job cannot change; give --collectives "
                          f"horovod, or drop --min-np and --max-np")
    if config.format == "jobset":
        raise ConfigError(f"--min-np {least} / --max-np {most} with --format jobset: a "
                          f"JobSet's replicatedJobs cannot be changed once it exists, so its "
                          f"worker Job cannot be scaled; give --format job")


def _validate_jobset(config: K8sConfig) -> None:
    """What a JobSet cannot express the way --format job does: refused, with the way out."""
    if config.format != "jobset":
        return
    if config.keep_servers:
        raise ConfigError("--keep-servers with --format jobset: the JobSet owns its servers "
                          "and deletes them when the workers complete or it fails; give "
                          "--format job --keep-servers for servers that outlive the job")
    if config.data_volume_size:
        raise ConfigError(f"--data-volume-size {config.data_volume_size} with --format jobset: "
                          f"a claim per server is a StatefulSet's volumeClaimTemplates, which "
                          f"a JobSet has not (its volumeClaimPolicies share one claim among "
                          f"all pods); give --format job, or mount a volume of your own at "
                          f"--data-dir with --patch")
    if config.service_monitor:
        raise ConfigError("--service-monitor with --format jobset: the ServiceMonitor selects "
                          "the servers' Service JOB-ps, and a JobSet's pods have only the "
                          "JobSet's own headless Service, without ports; give --format job, "
                          "or scrape the pods labelled parallax.io/role=ps with a PodMonitor "
                          "of your own (--metrics-namespace lets it in)")


def _validate_plan(plan: Mapping[str, Any]) -> None:
    if not isinstance(plan, Mapping):
        raise ConfigError(f"--plan must be a JSON object, not {plan!r}")
    unknown = sorted(set(plan) - set(PLAN_KEYS))
    if unknown:
        raise ConfigError(f"--plan keys {unknown} are not plan overrides; use "
                          f"{', '.join(PLAN_KEYS)} (the ParallaxStrategy arguments)")
    placement = plan.get("placement", {})
    if not isinstance(placement, Mapping) or any(
            not isinstance(k, str) or v not in ("ps", "allreduce") for k, v in placement.items()):
        raise ConfigError(f"--plan placement {placement!r} must map variable names to 'ps' "
                          f"or 'allreduce', e.g. {{\"embedding/embeddings\": \"ps\"}}")
    shards = plan.get("shards")
    counts = list(shards.values()) if isinstance(shards, Mapping) else [shards]
    if shards is not None and any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                                  for c in counts):
        raise ConfigError(f"--plan shards {shards!r} must be a positive int or a map of "
                          f"variable name to positive int")
    if not isinstance(plan.get("local_aggregation", False), bool):
        raise ConfigError(f"--plan local_aggregation {plan['local_aggregation']!r} must be "
                          f"true or false")
    if plan.get("search_partitions", "auto") not in ("auto", True, False):
        raise ConfigError(f"--plan search_partitions {plan['search_partitions']!r} must be "
                          f'true, false or "auto" (measured tuning of shard counts)')
