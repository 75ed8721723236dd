"""`parallax k8s`: Kubernetes manifests for a parallax job, and the worker pods' bootstrap.

`render(K8sConfig(...))` returns the objects of one job, in the order to apply them:

  ConfigMap       JOB-config   job.json: mode, sync, sizes, server addresses, plan overrides
  Secret          JOB-token    the job's token (not with --token-secret or --insecure); with
  Secret          JOB-tls-*    --secure the servers' and the workers' TLS files
  NetworkPolicy   JOB          only the job's pods reach the job's pods (not with --insecure);
  NetworkPolicy   JOB-metrics  with --metrics-namespace/--metrics-pod-label, those scrape too
  ServiceAccount  JOB-ps       with a Role and a RoleBinding: the servers' job watcher may
  Role            JOB-ps       get the Job JOB-worker and delete the StatefulSet JOB-ps,
  RoleBinding     JOB-ps       nothing else (not with --keep-servers)
  Service         JOB-ps       headless (clusterIP: None): stable DNS names for the servers,
                               JOB-ps-<i>.JOB-ps.<ns>.svc.cluster.local:<port>, and their
                               metrics port
  StatefulSet     JOB-ps       S pods running `parallax server --host 0.0.0.0 --port <port>`,
                               ready when grpc.health.v1 says SERVING (the kubelet's gRPC
                               probe; a TCP probe with --secure), beside a `parallax k8s
                               watch-job` container
  ServiceMonitor  JOB-ps       with --service-monitor: the Prometheus Operator scrapes them
  Service         JOB-workers  headless: DNS names for the worker pods (the Job's subdomain)
  Job             JOB-worker   indexed (completionMode: Indexed, parallelism = completions =
                               N), each pod runs `parallax k8s worker -- COMMAND`

Secure by default (parallax.launch.k8s_security): the token on every server port and on the
gang, mounted as a file; restricted pods; `--insecure` renders none of it and says so.

The servers' lifetime is the Job's. A StatefulSet cannot be owned by the Job at render time
(an ownerReference needs the Job's uid, known once it exists), its pods restart whatever
their exit code (restartPolicy Always: a server cannot just exit), and a JobSet needs a
controller a stock cluster lacks. So each server pod runs a small second container, `parallax
k8s watch-job`: with its own service account token (the server container gets none) it polls
the Job through the API server (HTTPS, no kubectl) and, once the Job has finished (Complete or
Failed) or was deleted, deletes the StatefulSet; its pods stop gracefully, the claims of
--data-volume-size stay (persistentVolumeClaimRetentionPolicy Retain). Nothing depends on a
worker being alive at the end.

How N worker pods become one Horovod (gloo) job without ssh. `horovodrun --gloo` does two
things: it serves a rendezvous (Horovod's `RendezvousServer`, an HTTP key-value store the
ranks use to exchange gloo addresses, initialised with the host plan so it knows the size of
the `global`, `local_<host>` and `cross_<local rank>` scopes), and it starts each rank with
HOROVOD_RANK / SIZE / LOCAL_RANK / LOCAL_SIZE / CROSS_RANK / CROSS_SIZE / HOSTNAME plus
HOROVOD_GLOO_RENDEZVOUS_ADDR / PORT, HOROVOD_CONTROLLER=gloo, HOROVOD_CPU_OPERATIONS=gloo and
HOROVOD_GLOO_IFACE (see horovod/runner/gloo_run.py). Here every pod is one Horovod "host"
with one slot, so rank = JOB_COMPLETION_INDEX (set by Kubernetes), local rank 0, local size
1, cross rank = rank, cross size = N, hostname `worker-<rank>`. `parallax k8s worker` sets
these; in the pod of index 0 it also serves the rendezvous (port `rendezvous_port`, the
same plan horovodrun would build) for as long as its training process runs; the other pods
wait until that port answers at JOB-worker-0.JOB-workers.<ns>.svc.cluster.local, resolve it
to an address and start. With one worker nothing of this is set: the command runs alone.

Workers also get PARALLAX_PS_ADDRESSES (the servers' DNS names), PARALLAX_RUN_ID (= JOB),
PARALLAX_MODE, PARALLAX_SYNC and PARALLAX_JOB_CONFIG (the mounted job.json), all read by
`ParallaxStrategy`: the plan overrides of job.json apply to the arguments it was not given
(`parallax.env.plan_overrides`; `parallax.env.strategy_options()` returns them all).

With --collectives tensorflow (an image without Horovod) there is no rendezvous: every worker
gets PARALLAX_WORKERS, the DNS names of all worker pods at --collective-port in rank order,
and `parallax k8s worker` sets PARALLAX_WORKER_RANK from JOB_COMPLETION_INDEX; TensorFlow's
servers find each other (`parallax.tf.tf_collectives`).

With --max-restarts N the pods restart together, in place (parallax.launch.gang: one failed rank
cannot rejoin a Horovod job, so every rank's command restarts with a fresh rendezvous); the
Job's backoffLimit (N x workers) and podFailurePolicy only recreate pods that were disrupted
or lost worker 0. The servers keep checkpoints in --data-dir on a PersistentVolumeClaim per
server (--data-volume-size) or an emptyDir, and PARALLAX_RUN_ID stays JOB across attempts.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Mapping

import yaml

from parallax.env import (ADDRESSES_ENV, GANG_TIMEOUT_ENV, JOB_CONFIG_ENV, MAX_RESTARTS_ENV,
                          MODE_ENV, PLAN_KEYS, RENDEZVOUS_ENV, RENDEZVOUS_TIMEOUT_ENV,
                          RESTART_COUNT_ENV, RUN_ID_ENV, RUN_MODES, SYNC_ENV, TOKEN_FILE_ENV,
                          WORKER_RANK_ENV, WORKERS_ENV)
from parallax.errors import ConfigError
from parallax.launch import gang
from parallax.launch import k8s_security as secure
from parallax.launch.rendezvous import host_plan as _host_plan
from parallax.launch.rendezvous import horovod_env, start_rendezvous  # noqa: F401 - API
from parallax.launch.k8s_labels import (  # noqa: F401 - LABEL_*: part of this module's API
    _SUBDOMAIN, LABEL_JOB, LABEL_ROLE, key_problem, parse_selector, value_problem)
from parallax.launch.k8s_labels import labels as _labels
from parallax.launch.k8s_labels import meta as _meta
from parallax.launch.restarts import RestartBudget
from parallax.protocol.security import read_token
from parallax.runtime import logs

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
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
WATCH_POLL_S = 15.0                     # how often the servers' watcher reads the Job
WATCHER = {"requests": {"cpu": "10m", "memory": "64Mi"},   # `parallax k8s watch-job`:
           "limits": {"cpu": "100m", "memory": "128Mi"}}  # ~55 MB resident, idle
K8S_COLLECTIVES = ("horovod", "tensorflow")  # no "auto": the image decides, not this machine
log = logging.getLogger("parallax")


@dataclass(frozen=True)
class K8sConfig:
    name: str                             # job name: a DNS-1123 label, also the run id
    image: str                            # an image built from this repository's Dockerfile
    command: tuple[str, ...]              # the training program, e.g. ("python", "train.py")
    workers: int = 1
    servers: int = 2                      # 0 only with mode="allreduce"
    namespace: str = "default"
    mode: str = "hybrid"                  # hybrid | ps | allreduce
    sync: bool = True
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


def _label(value: str, what: str, fix: str) -> None:
    if not isinstance(value, str) or len(value) > 63 or not _DNS_LABEL.match(value):
        raise ConfigError(f"{what} {value!r} is not a DNS-1123 label (lower-case letters, "
                          f"digits and '-', starting and ending with a letter or digit, at "
                          f"most 63 characters); {fix}")


def validate(config: K8sConfig) -> None:
    """Raise ConfigError naming the first bad field and the fix."""
    _label(config.name, "--name", "e.g. --name wordlm-1")
    if len(config.name) > MAX_NAME:
        raise ConfigError(f"--name {config.name!r} has {len(config.name)} characters; at most "
                          f"{MAX_NAME} (pod names add '-worker-<index>'): shorten it")
    _label(config.namespace, "--namespace", "e.g. --namespace default")
    if not isinstance(config.image, str) or not config.image or any(c.isspace()
                                                                  for c in config.image):
        raise ConfigError(f"--image {config.image!r} must be an image reference without "
                          f"spaces, e.g. registry.example.com/parallax:0.1")
    for name in ("command", "server_args", "worker_node_selector", "server_node_selector",
                 "worker_tolerations", "server_tolerations", "service_monitor_labels",
                 "metrics_namespaces", "metrics_pod_labels"):
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
    _validate_security(config)
    _validate_resources(config)
    _validate_scheduling(config)
    _validate_metrics(config)
    _validate_scrapers(config)
    _validate_restarts(config)
    _validate_plan(config.plan)
    if config.collectives == "tensorflow" and config.plan.get("local_aggregation"):
        raise ConfigError("--plan local_aggregation with --collectives tensorflow: local "
                          "aggregation gathers gradients through Horovod; drop one of them")


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


def server_data_dir(config: K8sConfig) -> str | None:
    """Where the servers keep checkpoints: --data-dir, else DEFAULT_DATA_DIR when a volume
    or restarts need one, else None (no checkpoints on the servers)."""
    if not config.servers:
        return None
    if config.data_dir or config.data_volume_size or config.max_restarts:
        return config.data_dir or DEFAULT_DATA_DIR
    return None


def ps_service_host(config: K8sConfig, index: int) -> str:
    return f"{config.name}-ps-{index}.{config.name}-ps.{config.namespace}.svc.cluster.local"


def ps_addresses(config: K8sConfig) -> list[str]:
    return [f"{ps_service_host(config, i)}:{config.server_port}" for i in range(config.servers)]


def worker_host(config: K8sConfig, index: int) -> str:
    """Worker pod `index`'s stable DNS name: an indexed Job's pod is named <job>-<index>;
    with `subdomain` it resolves as <job>-<index>.<subdomain>.<namespace>.svc.cluster.local"""
    return (f"{config.name}-worker-{index}.{config.name}-workers.{config.namespace}"
            f".svc.cluster.local")


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
    }


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
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    if config.servers:
        env[ADDRESSES_ENV] = ",".join(ps_addresses(config))
    if config.workers > 1 and config.collectives == "tensorflow":
        env[WORKERS_ENV] = ",".join(collective_addresses(config))  # the rank: the bootstrap
    elif config.workers > 1:
        env.update({
            RENDEZVOUS_ENV: rendezvous_address(config),
            "HOROVOD_SIZE": str(config.workers),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": config.gloo_iface,
        })
    if config.max_restarts:
        env[RENDEZVOUS_ENV] = rendezvous_address(config)  # worker 0 coordinates the gang
        env[MAX_RESTARTS_ENV] = str(config.max_restarts)
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
    if config.servers:
        ports = [("grpc", config.server_port)]
        if server_metrics_port(config):
            ports.append(("metrics", server_metrics_port(config)))
        objects += [] if config.keep_servers else _watcher_access(config)
        objects += [_headless_service(config, f"{config.name}-ps", "ps", ports),
                    _server_set(config)]
        objects += [_service_monitor(config)] if config.service_monitor else []
    objects += [_headless_service(config, f"{config.name}-workers", "worker",
                                  worker_ports(config) or [("rendezvous",
                                                            config.rendezvous_port)]),
                _worker_job(config)]
    for obj in objects:
        obj["metadata"]["namespace"] = config.namespace
    return json.loads(json.dumps(objects))  # no shared sub-objects (no YAML anchors)


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
                    *(["--data-dir", data_dir] if data_dir else [])],
        "ports": [{"name": "grpc", "containerPort": config.server_port},
                  {"name": "data", "containerPort": config.server_port + 1},
                  *([{"name": "metrics", "containerPort": metrics}] if metrics else [])],
        "readinessProbe": dict(probe, initialDelaySeconds=2),
        "livenessProbe": dict(probe, initialDelaySeconds=10, periodSeconds=10),
    }
    if data_dir:
        server["volumeMounts"] = [{"name": "data", "mountPath": data_dir}]
    if _resources(config, "ps"):
        server["resources"] = _resources(config, "ps")
    return server


def _data_claim(config: K8sConfig) -> dict[str, Any]:
    """volumeClaimTemplates entry: one PersistentVolumeClaim per server pod, data-JOB-ps-<i>,
    kept when pods restart or move (and when the StatefulSet is deleted: Retain)."""
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": str(config.data_volume_size)}}}
    if config.storage_class:
        spec["storageClassName"] = config.storage_class
    return {"metadata": {"name": "data", "labels": _labels(config, "ps")}, "spec": spec}


def _server_set(config: K8sConfig) -> dict[str, Any]:
    """The servers: a StatefulSet (stable names; pods restart by themselves, restartPolicy
    Always) whose data dir is a PersistentVolumeClaim per pod (--data-volume-size), kept when
    the watcher deletes the StatefulSet, or an emptyDir (survives container restarts, not a
    pod's move to another node)."""
    ps_labels = _labels(config, "ps")
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": 30, "restartPolicy": "Always",
                           "containers": [_server_container(config)], "volumes": [],
                           **_placement(config, "ps")}
    annotations = {"kubectl.kubernetes.io/default-container": "server"}
    if server_metrics_port(config) and config.insecure:  # a Prometheus that finds pods by
        # annotation sends no token: a secure job's metrics are scraped by ServiceMonitor
        annotations.update({"prometheus.io/scrape": "true", "prometheus.io/path": "/metrics",
                            "prometheus.io/port": str(server_metrics_port(config))})
    spec: dict[str, Any] = {
        "serviceName": f"{config.name}-ps", "replicas": config.servers,
        "podManagementPolicy": "Parallel", "selector": {"matchLabels": ps_labels},
        "template": {"metadata": {"labels": ps_labels, "annotations": annotations},
                     "spec": pod},
    }
    if server_data_dir(config):
        pod["securityContext"] = {"fsGroup": IMAGE_UID, "fsGroupChangePolicy": "OnRootMismatch"}
        if config.data_volume_size:
            spec["volumeClaimTemplates"] = [_data_claim(config)]
            spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Retain",
                                                            "whenScaled": "Retain"}
        else:
            pod["volumes"].append({"name": "data", "emptyDir": {}})
    if not config.keep_servers:
        _add_watcher(config, pod)
    secure.mount_credentials(config, pod, pod["containers"][0], "server")
    secure.restrict(config, pod)
    if not pod["volumes"]:
        del pod["volumes"]
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": _meta(config, f"{config.name}-ps", "ps"), "spec": spec}


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
    """The workers: an indexed Job, one pod per rank, each running `parallax k8s worker`.
    Without restarts one failed rank fails the Job (backoffLimit 0: Horovod cannot re-admit
    a rank). With --max-restarts N the pods restart their commands together, in place
    (parallax.launch.gang); the Job's backoff only recreates the pods when that gang lost worker 0
    or a pod was disrupted (see _failure_policy)."""
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
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": config.workers, "parallelism": config.workers,
        "backoffLimit": config.max_restarts * config.workers,
        "template": {
            "metadata": {"labels": _labels(config, "worker")},
            "spec": {"subdomain": f"{config.name}-workers", "restartPolicy": "Never",
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
    if config.max_restarts:
        spec["podFailurePolicy"] = _failure_policy()
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _meta(config, f"{config.name}-worker", "worker"), "spec": spec}


def worker_ports(config: K8sConfig) -> list[tuple[str, int]]:
    """The worker pods' ports: the rendezvous on worker 0 (a Horovod job, or the gang of
    --max-restarts), each worker's TensorFlow server (--collectives tensorflow)."""
    ports = []
    horovod = config.workers > 1 and config.collectives == "horovod"
    if horovod or config.max_restarts:
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


# ---------------------------------------------------------------------------------------
# The servers' watcher (`parallax k8s watch-job`), beside each server: ends them with the Job.

class KubeAPI:
    """The API server as a pod's service account reaches it, without kubectl or a client
    library: HTTPS to $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, verified with the
    account's ca.crt, the account's token read at every request (the kubelet rotates it)."""

    def __init__(self, url: str, token_file: str, ca_file: str, timeout: float = 10.0):
        self.url, self.token_file, self.timeout = url.rstrip("/"), token_file, timeout
        self.context = ssl.create_default_context(cafile=ca_file)

    @classmethod
    def in_cluster(cls, environ: Mapping[str, str] | None = None,
                   directory: str = SERVICE_ACCOUNT_DIR) -> "KubeAPI":
        environ = os.environ if environ is None else environ
        host = environ.get("KUBERNETES_SERVICE_HOST")
        if not host:
            raise ConfigError("KUBERNETES_SERVICE_HOST is not set: `parallax k8s watch-job` "
                              "runs in a server pod that `parallax k8s` rendered")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{environ.get('KUBERNETES_SERVICE_PORT', '443')}",
                   f"{directory}/token", f"{directory}/ca.crt")

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, dict]:
        """(HTTP status, JSON answer or {}); OSError when the API server cannot be reached."""
        token = Path(self.token_file).read_text().strip()
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method,
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json",
                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout,
                                        context=self.context) as answer:
                return answer.status, _json(answer.read())
        except urllib.error.HTTPError as err:
            return err.code, _json(err.read())


def _json(data: bytes) -> dict:
    try:
        value = json.loads(data or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def job_finished(job: Mapping[str, Any]) -> str | None:
    """"Complete" or "Failed" once the Job has that condition, else None."""
    for condition in job.get("status", {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return condition["type"]
    return None


class JobWatch:
    """Ends the servers with the Job: `check()` reads the Job once; once it has finished, or
    is gone after it was seen, `end_servers()` deletes the StatefulSet. A Job not created yet
    is waited for; a recreated one (another uid) is followed. Problems (unreachable API
    server, missing RBAC) are logged once each, and the watch goes on."""

    def __init__(self, api: KubeAPI, namespace: str, job: str, servers: str):
        self.api, self.job, self.servers = api, job, servers
        self.job_path = f"/apis/batch/v1/namespaces/{namespace}/jobs/{job}"
        self.servers_path = f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{servers}"
        self.uid: str | None = None
        self._told: set[str] = set()

    def _once(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            log.warning("%s", message)

    def _refused(self, status: int, what: str) -> None:
        fix = (f"apply the Role and RoleBinding {self.servers} rendered with the servers"
               if status in (401, 403) else "the watch goes on")
        self._once(f"{what}-{status}", f"cannot {what}: the API server answered HTTP "
                                       f"{status}; {fix}")

    def check(self) -> str | None:
        """Why the servers should end now, or None."""
        try:
            status, job = self.api.request("GET", self.job_path)
        except OSError as err:
            self._once("unreachable", f"cannot reach the API server at {self.api.url} "
                                      f"({err}); the watch goes on")
            return None
        if status == 404:
            return f"Job {self.job} was deleted" if self.uid else None
        if status != 200:
            self._refused(status, f"read Job {self.job}")
            return None
        uid = job.get("metadata", {}).get("uid")
        if self.uid is None or uid != self.uid:
            log.info("watching Job %s (uid %s): the servers end with it", self.job, uid)
            self.uid = uid
        state = job_finished(job)
        return f"Job {self.job} finished ({state})" if state else None

    def end_servers(self) -> bool:
        """Delete the StatefulSet (its pods stop gracefully, its claims stay); True once
        it is deleted or gone."""
        try:
            status, _ = self.api.request("DELETE", self.servers_path, {
                "apiVersion": "v1", "kind": "DeleteOptions",
                "propagationPolicy": "Background"})
        except OSError as err:
            self._once("unreachable-delete", f"cannot reach the API server at "
                                             f"{self.api.url} ({err}); trying again")
            return False
        if status in (200, 202, 404):
            return True
        self._refused(status, f"delete StatefulSet {self.servers}")
        return False


def watch_job(watch: JobWatch, stop: threading.Event, poll_s: float = WATCH_POLL_S) -> bool:
    """Poll until the servers should end, then end them; False when `stop` came first."""
    while not stop.is_set():
        reason = watch.check()
        if reason:
            log.info("%s: deleting StatefulSet %s (its volume claims stay)", reason,
                     watch.servers)
            while not watch.end_servers():
                if stop.wait(poll_s):
                    return False
            return True
        stop.wait(poll_s)
    return False


def _watch_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="parallax k8s watch-job",
        description="Inside a server pod: delete the servers' StatefulSet once the worker "
                    "Job has finished or was deleted (the manifests of `parallax k8s` run "
                    "it beside each server).")
    p.add_argument("--namespace", required=True, help="the job's namespace")
    p.add_argument("--job", required=True, help="the worker Job's name (JOB-worker)")
    p.add_argument("--servers", required=True, help="the servers' StatefulSet (JOB-ps)")
    p.add_argument("--poll-seconds", type=float, default=WATCH_POLL_S,
                   help=f"how often to read the Job (default {WATCH_POLL_S:g})")
    return p


def watch_main(argv: list[str]) -> int:
    args = logs.parse(_watch_parser(), argv)
    try:
        watch = JobWatch(KubeAPI.in_cluster(), args.namespace, args.job, args.servers)
    except (ConfigError, OSError) as err:
        print(f"parallax k8s watch-job: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    watch_job(watch, stop, args.poll_seconds)
    stop.wait()  # exiting would only restart this container (restartPolicy Always)
    return 0


# ---------------------------------------------------------------------------------------
# Worker bootstrap (`parallax k8s worker -- COMMAND`), run inside each worker pod.

def _wait_for(host: str, port: int, timeout: float) -> str:
    """Resolve host and wait until host:port accepts connections; returns its address."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            address = socket.gethostbyname(host)
            with socket.create_connection((address, port), timeout=2):
                return address
        except OSError as err:
            last = err
            time.sleep(1)
    raise ConfigError(f"the Horovod rendezvous at {host}:{port} (served by worker 0) did not "
                      f"answer within {timeout:.0f} s ({last}); is worker 0 running? raise "
                      f"{RENDEZVOUS_TIMEOUT_ENV} if pods start slowly")


def _rank(environ: Mapping[str, str], size: int) -> int | None:
    rank = int(environ.get("JOB_COMPLETION_INDEX", environ.get("HOROVOD_RANK", "-1")))
    if not 0 <= rank < size:
        print(f"parallax k8s worker: rank {rank} (JOB_COMPLETION_INDEX) is not in 0..{size - 1}",
              file=sys.stderr)
        return None
    return rank


def _join(environ: Mapping[str, str], rank: int, size: int, coordinator=None,
          token: str | None = None):
    """Rank 0 serves the rendezvous, the others wait for it: (server or None, the address
    to reach it at, its port). Raises OSError or ConfigError."""
    host, _, port_text = environ[RENDEZVOUS_ENV].rpartition(":")
    port = int(port_text)
    if rank == 0:
        return start_rendezvous(port, size, coordinator=coordinator,
                                horovod=size > 1 and not _tensorflow(environ), token=token), \
            "127.0.0.1", port
    timeout = float(environ.get(RENDEZVOUS_TIMEOUT_ENV, "300"))
    return None, _wait_for(host, port, timeout), port


def _stop(server) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


def worker_main(command: list[str], environ: Mapping[str, str] | None = None) -> int:
    environ = dict(os.environ if environ is None else environ)
    if not command:
        print("parallax k8s worker: no command; usage: parallax k8s worker -- COMMAND",
              file=sys.stderr)
        return 2
    size = len(environ[WORKERS_ENV].split(",")) if _tensorflow(environ) else \
        int(environ.get("HOROVOD_SIZE", "1"))
    max_restarts = int(environ.get(MAX_RESTARTS_ENV, "0"))
    rank = _rank(environ, size) if size > 1 or max_restarts else 0
    if rank is None:
        return 2
    if _tensorflow(environ):
        environ[WORKER_RANK_ENV] = str(rank)
    if max_restarts:
        return _gang_main(command, environ, rank, size, max_restarts)
    if size <= 1 or _tensorflow(environ):  # (TensorFlow's workers find each other)
        os.execvpe(command[0], command, environ)
    try:
        server, address, port = _join(environ, rank, size)
    except (OSError, ConfigError) as err:
        print(f"parallax k8s worker {rank}: {err}", file=sys.stderr)
        return 1
    environ.update(horovod_env(rank, size, address, port,
                               environ.get("HOROVOD_GLOO_IFACE", "eth0")))
    child = subprocess.Popen(command, env=environ)

    def forward(signum, _frame):
        child.send_signal(signum)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = child.wait()
    _stop(server)
    return code if code >= 0 else 128 - code


def _tensorflow(environ: Mapping[str, str]) -> bool:
    """Whether the manifests gave this job TensorFlow's collectives (--collectives)."""
    return bool(environ.get(WORKERS_ENV))


def _say(text: str) -> None:
    print(f"parallax k8s worker 0: {text}", flush=True)


def _fresh_start(environ: Mapping[str, str], server, size: int, timeout: float):
    """Worker 0, before each attempt: a new rendezvous (a fresh gloo context), and none of
    this run's tables left on the servers, as if they had restarted (the checkpoints on
    their data volume stay; the workers' scripts restore from them)."""
    def start(attempt: int) -> None:
        if size > 1 and not _tensorflow(environ):
            server.init(_host_plan(size))
        addresses = environ.get(ADDRESSES_ENV)
        if not addresses:
            return
        from parallax.client.connection import client_options_from_env
        from parallax.client.ps_client import PSClient
        with PSClient(addresses.split(","), client_options_from_env(environ=environ)) as client:
            client.wait_ready(timeout)
            dropped = client.delete_tables(f"{environ[RUN_ID_ENV]}.")
        if dropped:
            _say(f"attempt {attempt}: dropped {len(dropped)} table(s) of run "
                 f"{environ[RUN_ID_ENV]} from the servers; the workers restore them from "
                 f"their last checkpoint")
    return start


def _gang_token(environ: Mapping[str, str], rank: int) -> str | None:
    """The job's token (the file PARALLAX_TOKEN_FILE names, mounted from its Secret), which
    every gang request carries; None, with a warning, for a job rendered --insecure."""
    if environ.get(TOKEN_FILE_ENV):
        return read_token(environ[TOKEN_FILE_ENV])
    if rank == 0:
        _say(f"no {TOKEN_FILE_ENV}: the gang at the rendezvous port accepts requests from "
             f"any pod (rendered with --insecure)")
    return None


def _gang_main(command: list[str], environ: dict[str, str], rank: int, size: int,
               max_restarts: int) -> int:
    """Run `command` under the gang's supervision (parallax.launch.gang): every rank's command
    restarts together after any failure, at most `max_restarts` times."""
    timeout = float(environ.get(GANG_TIMEOUT_ENV, gang.GANG_TIMEOUT_S))
    try:
        token = _gang_token(environ, rank)
    except ConfigError as err:
        print(f"parallax k8s worker {rank}: {err}", file=sys.stderr)
        return 2
    coordinator = None
    if rank == 0:
        coordinator = gang.Gang(size, RestartBudget(max_restarts, say=_say), lambda _: None,
                                timeout, say=_say)
    try:
        server, address, port = _join(environ, rank, size, coordinator, token)
    except (OSError, ConfigError) as err:  # worker 0 not there: the Job may recreate pods
        print(f"parallax k8s worker {rank}: {err}", file=sys.stderr)
        return 1 if rank == 0 else gang.LOST_GANG_EXIT
    stop = threading.Event()
    if coordinator is not None:
        coordinator.on_start = _fresh_start(environ, server, size, timeout)
        gang.run_steps(coordinator, stop)

    def child_env(attempt: int) -> dict[str, str]:
        env = dict(environ, **{RESTART_COUNT_ENV: str(attempt)})
        if size > 1 and not _tensorflow(environ):
            env.update(horovod_env(rank, size, address, port,
                                   environ.get("HOROVOD_GLOO_IFACE", "eth0")))
        return env
    code = gang.Supervisor(f"http://{address}:{port}", rank, command, child_env,
                           timeout, token).run()
    if coordinator is not None:  # let the others read the final state before leaving
        deadline = time.monotonic() + timeout
        while not coordinator.everyone_told() and time.monotonic() < deadline:
            time.sleep(gang.POLL_S)
    stop.set()
    _stop(server)
    return code


# ---------------------------------------------------------------------------------------
# `parallax k8s` command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="parallax k8s",
        usage="parallax k8s --name JOB --image IMAGE [OPTIONS] [-o DIR] -- COMMAND [ARGS ...]\n"
              "       parallax k8s worker -- COMMAND [ARGS ...]   (inside a worker pod)\n"
              "       parallax k8s watch-job ...                 (inside a server pod)",
        description="Render the Kubernetes manifests of a parallax job (parameter servers "
                    "as a StatefulSet with a headless Service, ending with the job; workers "
                    "as an indexed Job; a ConfigMap with the job config) to stdout, or to "
                    "files in -o DIR.")
    _job_options(p.add_argument_group("job"))
    _resource_options(p.add_argument_group("resources and scheduling"))
    _server_options(p.add_argument_group("servers"))
    _security_options(p.add_argument_group("security (default: a token on every port, a "
                                            "NetworkPolicy, restricted pods)"))
    p.add_argument("-o", "--output-dir", metavar="DIR",
                   help="write one YAML file per object here (default: all to stdout)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the training program, after '--', e.g. -- python train.py")
    return p


def _job_options(g) -> None:
    g.add_argument("--name", required=True, help="job name (DNS-1123 label); also the run id")
    g.add_argument("--image", required=True, help="image built from parallax's Dockerfile")
    g.add_argument("--namespace", default="default", metavar="NS",
                   help="namespace of every object (default: default)")
    g.add_argument("--workers", type=int, default=1, metavar="N",
                   help="worker pods (default 1)")
    g.add_argument("--servers", type=int, default=2, metavar="S",
                   help="parameter servers (default 2)")
    g.add_argument("--mode", default="hybrid", metavar="MODE",
                   help="hybrid (default), ps or allreduce")
    g.add_argument("--async", dest="sync", action="store_false", help="asynchronous training")
    g.add_argument("--plan", default="{}", metavar="JSON", help='plan overrides as JSON, e.g. '
                   '\'{"shards": 4, "placement": {"dense/kernel": "ps"}}\'; ParallaxStrategy '
                   'applies those its own arguments leave unset')
    g.add_argument("--rendezvous-port", type=int, default=7070, metavar="P",
                   help="Horovod gloo rendezvous port on worker 0 (default 7070)")
    g.add_argument("--collectives", choices=K8S_COLLECTIVES, default="horovod",
                   help="how the workers sum dense gradients: horovod (default; the image "
                        "needs Horovod, as the Dockerfile's has) or tensorflow (TensorFlow's "
                        "collective ops, no Horovod: e.g. an image on the newest TensorFlow)")
    g.add_argument("--collective-port", type=int, default=7080, metavar="P",
                   help="with --collectives tensorflow: each worker's TensorFlow server port "
                        "(default 7080)")
    g.add_argument("--gloo-iface", default="eth0", metavar="IFACE",
                   help="pod network interface (default eth0)")
    g.add_argument("--image-pull-policy", default="IfNotPresent", metavar="POLICY",
                   help="Always, IfNotPresent (default) or Never")
    g.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="after a worker's command fails, restart every worker's command "
                        "together, in its pod, at most N times (default 0: the job fails); "
                        f"they get {RESTART_COUNT_ENV} and resume from their last "
                        "checkpoint. The Job recreates lost pods within backoffLimit = N x "
                        "workers")


def _resource_options(g) -> None:
    for role, pods in (("", "every pod"), ("server-", "the server pods")):
        for what, example in (("cpu", "2 or 500m"), ("memory", "4Gi")):
            for kind, suffix in (("request", ""), ("limit", "-limit")):
                default = f" (default: --{what}{suffix})" if role else ""
                g.add_argument(f"--{role}{what}{suffix}", metavar="Q",
                               help=f"{what} {kind} of {pods}, e.g. {example}{default}")
    g.add_argument("--gpus", type=int, default=0, metavar="N",
                   help=f"{GPU_RESOURCE} limit of each worker pod: 0 (default) or 1 (a pod "
                        "is one Horovod rank)")
    for role in ("worker", "server"):
        g.add_argument(f"--{role}-node-selector", action="append", default=[],
                       metavar="KEY=VALUE",
                       help=f"a node label the {role} pods need (repeatable), e.g. "
                            "cloud.google.com/gke-nodepool=pool-1")
        g.add_argument(f"--{role}-toleration", action="append", default=[],
                       metavar="KEY[=VALUE][:EFFECT]",
                       help=f"a taint the {role} pods tolerate (repeatable): KEY=VALUE "
                            f"matches that value, KEY alone any; EFFECT is one of "
                            f"{', '.join(EFFECTS)} (default: all), e.g. "
                            f"{GPU_RESOURCE}=present:NoSchedule")


def _server_options(g) -> None:
    g.add_argument("--server-port", type=int, default=7000, metavar="P",
                   help="the servers' gRPC port (default 7000); their data plane listens on "
                        "the port after it")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra `parallax server` argument, e.g. --server-arg=--threads=32")
    g.add_argument("--keep-servers", action="store_true",
                   help="do not end the servers with the worker Job (no job-watch container, "
                        "ServiceAccount, Role or RoleBinding): delete them yourself")
    g.add_argument("--data-dir", metavar="DIR",
                   help="the servers' --data-dir, where they write checkpoints (resume/<run "
                        f"id>); default {DEFAULT_DATA_DIR} with --max-restarts or "
                        "--data-volume-size, else none")
    g.add_argument("--data-volume-size", metavar="Q",
                   help="a PersistentVolumeClaim of this size per server mounted at "
                        "--data-dir, so a restarted or moved server pod keeps its "
                        "checkpoints, e.g. 10Gi (default: an emptyDir, lost with the pod)")
    g.add_argument("--storage-class", metavar="NAME",
                   help="storageClassName of those claims (default: the cluster's default)")
    g.add_argument("--metrics-port", type=int, default=None, metavar="P",
                   help="the servers' Prometheus /metrics port, in their Service as "
                        "\"metrics\" (default: --server-port + 2; 0: none)")
    g.add_argument("--service-monitor", action="store_true",
                   help="also render a Prometheus Operator ServiceMonitor "
                        "(monitoring.coreos.com/v1) scraping the servers")
    g.add_argument("--service-monitor-label", action="append", default=[],
                   metavar="KEY=VALUE",
                   help="a label of the ServiceMonitor (repeatable): what your Prometheus "
                        "selects ServiceMonitors by, e.g. release=prometheus")


def _security_options(g) -> None:
    g.add_argument("--token-secret", metavar="NAME",
                   help="an existing Secret whose key \"token\" is the job's token (default: "
                        "a generated Secret JOB-token in the manifests)")
    g.add_argument("--secure", action="store_true",
                   help="mutual TLS on the servers' ports too: a CA and certificates made "
                        f"now (valid {secure.CERT_DAYS} days) in Secrets JOB-tls-server and "
                        "JOB-tls-client")
    g.add_argument("--metrics-namespace", action="append", default=[], metavar="NS",
                   help="pods of this namespace may scrape the servers' metrics port "
                        "(repeatable; e.g. monitoring); with the token, as the "
                        "ServiceMonitor sends it")
    g.add_argument("--metrics-pod-label", action="append", default=[], metavar="KEY=VALUE",
                   help="pods of the job's namespace with this label may scrape the "
                        "servers' metrics port (repeatable)")
    g.add_argument("--insecure", action="store_true",
                   help="render the open shape: no token, TLS, NetworkPolicy or restricted "
                        "pods; any pod in the cluster can reach the servers and the gang")


def config_from_args(argv: list[str]) -> tuple[K8sConfig, str | None]:
    args = logs.parse(_parser(), argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        plan = json.loads(args.plan)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--plan {args.plan!r} is not JSON ({err}); e.g. "
                          f"--plan '{{\"shards\": 4}}'") from None
    resources = {name: getattr(args, name) for name in RESOURCE_FIELDS
                 + tuple(f"server_{n}" for n in RESOURCE_FIELDS)}
    config = K8sConfig(
        name=args.name, image=args.image, command=tuple(command), workers=args.workers,
        servers=args.servers, namespace=args.namespace, mode=args.mode, sync=args.sync,
        server_port=args.server_port, rendezvous_port=args.rendezvous_port, plan=plan,
        collectives=args.collectives, collective_port=args.collective_port,
        server_args=tuple(args.server_arg), gloo_iface=args.gloo_iface,
        image_pull_policy=args.image_pull_policy, max_restarts=args.max_restarts,
        data_dir=args.data_dir, data_volume_size=args.data_volume_size,
        storage_class=args.storage_class, gpus=args.gpus, **resources,
        worker_node_selector=tuple(args.worker_node_selector),
        server_node_selector=tuple(args.server_node_selector),
        worker_tolerations=tuple(args.worker_toleration),
        server_tolerations=tuple(args.server_toleration), keep_servers=args.keep_servers,
        metrics_port=args.metrics_port, service_monitor=args.service_monitor,
        service_monitor_labels=tuple(args.service_monitor_label), insecure=args.insecure,
        token_secret=args.token_secret, secure=args.secure,
        metrics_namespaces=tuple(args.metrics_namespace),
        metrics_pod_labels=tuple(args.metrics_pod_label))
    return config, args.output_dir


def write(objects: list[dict[str, Any]], directory: str,
          note: str | None = None) -> list[Path]:
    """One YAML file per object in `directory`; a Secret's file is readable by its owner only."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, obj in enumerate(objects):
        path = out / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        if obj["kind"] == "Secret":
            path.unlink(missing_ok=True)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        path.write_text(dump([obj], note))
        paths.append(path)
    return paths


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:
        rest = argv[1:]
        return worker_main(rest[1:] if rest[:1] == ["--"] else rest)
    if argv[:1] == ["watch-job"]:
        return watch_main(argv[1:])
    try:
        config, output_dir = config_from_args(argv)
        objects = render(config)
    except ConfigError as err:
        print(f"parallax k8s: {err}", file=sys.stderr)
        return 2
    note = secure.INSECURE_NOTE if config.insecure else None
    if note:
        print(f"parallax k8s: warning: {note}", file=sys.stderr)
    if output_dir:
        for path in write(objects, output_dir, note):
            print(path, file=sys.stderr)
    else:
        sys.stdout.write(dump(objects, note))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
