"""`parallax k8s`: Kubernetes manifests for a parallax job, and the worker pods' bootstrap.

`render(K8sConfig(...))` returns the objects of one job, in the order to apply them
(Kubernetes 1.29 or newer, `MIN_KUBERNETES`: CI validates them against the schemas of
1.29 and of the newest release kubernetes-validate knows):

  ConfigMap       JOB-config   job.json: mode, sync, sizes, server addresses, plan overrides
  Secret          JOB-token    the job's token (not with --token-secret or --insecure); with
  Secret          JOB-tls-*    --secure the servers' and the workers' TLS files
  NetworkPolicy   JOB          only the job's pods reach the job's pods (not with --insecure);
  NetworkPolicy   JOB-metrics  with --metrics-namespace/--metrics-pod-label, those scrape too
  ServiceAccount  JOB-ps       with a Role and a RoleBinding: the servers' job watcher may
  Role            JOB-ps       get the Job JOB-worker and delete the StatefulSet JOB-ps,
  RoleBinding     JOB-ps       nothing else (not with --keep-servers)
  Service         JOB-ps       headless (clusterIP: None): stable DNS names for the servers,
                               JOB-ps-<i>.JOB-ps.<ns>.svc.<--cluster-domain>:<port>, and their
                               metrics port
  StatefulSet     JOB-ps       S pods running `parallax server --host 0.0.0.0 --port <port>`,
                               ready when grpc.health.v1 says SERVING (the kubelet's gRPC
                               probe; a TCP probe with --secure), beside a `parallax k8s
                               watch-job` container
  ServiceMonitor  JOB-ps       with --service-monitor: the Prometheus Operator scrapes them
  Service         JOB-workers  headless: DNS names for the worker pods (the Job's subdomain)
  Job             JOB-worker   indexed (completionMode: Indexed, parallelism = completions =
                               N), each pod runs `parallax k8s worker -- COMMAND`

With --format jobset (clusters running the JobSet controller, MIN_JOBSET or newer;
parallax.launch.k8s_jobset) the ConfigMap, the Secrets and the NetworkPolicies stay, and one
object replaces the rest (no ServiceAccount, Role, RoleBinding, watcher or Service of ours):

  JobSet          JOB          jobset.x-k8s.io/v1alpha2: replicated job `ps`, an indexed Job
                               of S servers (restartPolicy OnFailure), and `worker`, the
                               indexed Job of N workers, created once the servers are Ready
                               (dependsOn); the JobSet's own headless Service JOB names
                               their pods JOB-ps-0-<i>.JOB and JOB-worker-0-<i>.JOB (.<ns>.svc
                               .<--cluster-domain>); it completes when the workers have
                               (successPolicy), deleting the servers, and restarts as a whole
                               (failurePolicy maxRestarts = --max-restarts)

Secure by default (parallax.launch.k8s_security): the token on every server port and on the
gang, mounted as a file; restricted pods; `--insecure` renders none of it and says so.

The servers' lifetime is the Job's. A StatefulSet cannot be owned by the Job at render time
(an ownerReference needs the Job's uid, known once it exists), its pods restart whatever
their exit code (restartPolicy Always: a server cannot just exit), and a JobSet needs a
controller a stock cluster lacks (--format jobset, where it has one). So each server pod
runs a small second container, `parallax k8s watch-job`: with its own service account token
(the server container gets none) it polls the Job through the API server (HTTPS, no kubectl)
and, once the Job has finished (Complete or Failed) or was deleted, deletes the StatefulSet;
its pods stop gracefully, the claims of --data-volume-size stay
(persistentVolumeClaimRetentionPolicy Retain). Nothing depends on a worker being alive at the
end.

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
servers find each other (`parallax.tf.collectives.tensorflow`).

With --max-restarts N the pods restart together, in place (parallax.launch.gang: one failed rank
cannot rejoin a Horovod job, so every rank's command restarts with a fresh rendezvous); the
Job's backoffLimit (N x workers) and podFailurePolicy only recreate pods that were disrupted
or lost worker 0. The servers keep checkpoints in --data-dir on a PersistentVolumeClaim per
server (--data-volume-size) or an emptyDir, and PARALLAX_RUN_ID stays JOB across attempts.

With --replay-mb N every worker keeps N MiB of its pushes (PARALLAX_REPLAY_MB) and each
server runs with --restore-newest-on-restart $(PARALLAX_POD_UID), its pod's uid: a container
restarted in its pod restores its newest checkpoint saved since the pod started and the
workers replay their pushes since; a pod's first start never restores (parallax_ps.instance).

With --min-np A --max-np B the worker Job may be scaled (`kubectl patch` of completions and
parallelism together, between A and B): worker 0's gang runs each attempt with the pods
there, and stops the commands at their next checkpoint whenever a pod comes or announces it
leaves (parallax.launch.gang.Scaling), giving each attempt its own Horovod size and ranks.

The modules, one role each: k8s_config (K8sConfig and its validation), k8s_render (the
objects and their YAML), k8s_jobset (the JobSet of --format jobset), k8s_watch (the servers'
job watcher), k8s_bootstrap (the worker pods' bootstrap), k8s_patch, k8s_security and
k8s_labels; this one is the command line, and re-exports
what the others define so that `from parallax.launch.k8s import ...` keeps working.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from parallax.env import REPLAY_ENV, RESTART_COUNT_ENV
from parallax.errors import ConfigError
from parallax.launch import gang  # noqa: F401 - part of this module's API (k8s.gang)
from parallax.launch.gang import ELASTIC_TIMEOUT_S
from parallax.launch import k8s_security as secure
from parallax.launch.k8s_bootstrap import _fresh_start  # noqa: F401 - tests call it here
from parallax.launch.k8s_bootstrap import worker_main
from parallax.launch.k8s_config import (CONFIG_DIR, CONFIG_FILE, DEFAULT_DATA_DIR, EFFECTS,
                                        FORMATS, GPU_RESOURCE, IMAGE_UID, JOBSET_API,
                                        K8S_COLLECTIVES, MAX_NAME, MIN_JOBSET,
                                        MIN_KUBERNETES, RESOURCE_FIELDS, SECURITY_ARGS,
                                        SERVER_WAIT_S, K8sConfig,
                                        node_selector, parse_toleration, resource_setting,
                                        server_metrics_port, tolerations, validate)
from parallax.launch.k8s_labels import LABEL_JOB, LABEL_ROLE, key_problem, parse_selector, \
    value_problem
from parallax.launch.k8s_render import (WATCHER, collective_addresses, dump, job_config,
                                        ps_addresses, ps_service_host, render,
                                        rendezvous_address, server_data_dir, worker_env,
                                        worker_host, worker_ports)
from parallax.launch.k8s_watch import _watch_parser  # noqa: F401 - tests call it here
from parallax.launch.k8s_watch import (SERVICE_ACCOUNT_DIR, WATCH_POLL_S, JobWatch, KubeAPI,
                                       job_finished, watch_job, watch_main)
from parallax.launch.rendezvous import horovod_env, start_rendezvous
from parallax.launch.warm import WARM_STARTS
from parallax.runtime import logs

__all__ = [
    "CONFIG_DIR", "CONFIG_FILE", "DEFAULT_DATA_DIR", "EFFECTS", "FORMATS", "GPU_RESOURCE",
    "IMAGE_UID", "JOBSET_API", "K8S_COLLECTIVES", "LABEL_JOB", "LABEL_ROLE", "MAX_NAME",
    "MIN_JOBSET", "RESOURCE_FIELDS",
    "SECURITY_ARGS", "SERVICE_ACCOUNT_DIR", "WATCHER", "WATCH_POLL_S", "JobWatch",
    "K8sConfig", "KubeAPI", "collective_addresses", "config_from_args", "dump",
    "horovod_env", "job_config", "job_finished", "key_problem", "main", "node_selector",
    "parse_selector", "parse_toleration", "ps_addresses", "ps_service_host", "render",
    "rendezvous_address", "resource_setting", "server_data_dir", "server_metrics_port",
    "start_rendezvous", "tolerations", "validate", "value_problem", "watch_job",
    "watch_main", "worker_env", "worker_host", "worker_main", "worker_ports", "write",
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="parallax k8s",
        usage="parallax k8s --name JOB --image IMAGE [OPTIONS] [-o DIR] -- COMMAND [ARGS ...]\n"
              "       parallax k8s worker -- COMMAND [ARGS ...]   (inside a worker pod)\n"
              "       parallax k8s watch-job ...                 (inside a server pod)",
        description="Render the Kubernetes manifests of a parallax job (parameter servers "
                    "as a StatefulSet with a headless Service, ending with the job; workers "
                    "as an indexed Job; a ConfigMap with the job config; or, with --format "
                    "jobset, both as one JobSet) to stdout, or to files in -o DIR.")
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
    g.add_argument("--format", choices=FORMATS, default="job",
                   help="job (default): the servers as a StatefulSet ended by a watcher, the "
                        "workers as an indexed Job, on any cluster; jobset: one JobSet "
                        f"({JOBSET_API}, the JobSet controller {MIN_JOBSET} or newer) whose "
                        "status is the job's, no watcher and no Role to create")
    g.add_argument("--namespace", default="default", metavar="NS",
                   help="namespace of every object (default: default)")
    g.add_argument("--patch", action="append", default=[], metavar="FILE",
                   help="YAML merged into the rendered objects (repeatable): each document "
                        "names its target by kind and metadata.name; mappings merge, lists of "
                        "named items (containers, env, volumes) merge by name, other values "
                        "replace, null removes (parallax.launch.k8s_patch)")
    g.add_argument("--cluster-domain", default="cluster.local", metavar="DOMAIN",
                   help="the cluster's DNS domain, in the servers' and workers' addresses "
                        "(default: cluster.local)")
    g.add_argument("--server-wait", type=float, default=SERVER_WAIT_S, metavar="S",
                   help="seconds the workers give each server to answer at the first step "
                        f"(default {SERVER_WAIT_S:g}: a server pod may first wait for its "
                        "volume or pull its image; watch the StatefulSet JOB-ps)")
    g.add_argument("--workers", "-np", type=int, default=1, metavar="N",
                   help="worker pods (default 1); with --min-np/--max-np, those the Job "
                        "starts with")
    g.add_argument("--min-np", dest="min_workers", type=int, default=None, metavar="N",
                   help="an elastic Job: the fewest worker pods to train with when it is "
                        "scaled (kubectl patch of completions and parallelism; default -np)")
    g.add_argument("--max-np", dest="max_workers", type=int, default=None, metavar="N",
                   help="an elastic Job: the most worker pods (default -np); the gang stops "
                        "at a checkpoint and goes on with the pods there whenever they change")
    g.add_argument("--elastic-timeout", type=float, default=ELASTIC_TIMEOUT_S, metavar="S",
                   help="seconds worker 0 waits for --min-np pods before the job fails "
                        f"(default {ELASTIC_TIMEOUT_S:g})")
    g.add_argument("--servers", type=int, default=2, metavar="S",
                   help="parameter servers (default 2)")
    g.add_argument("--mode", default="hybrid", metavar="MODE",
                   help="hybrid (default), ps or allreduce")
    g.add_argument("--async", dest="sync", action="store_false", help="asynchronous training")
    g.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="copies of each table shard: 2 keeps one on the next server pod too, "
                        "so that a server pod's death loses no step (default 1)")
    g.add_argument("--replay-mb", type=int, default=0, metavar="N",
                   help="each worker keeps up to N MiB of its pushes to each server "
                        f"({REPLAY_ENV}); a server container that Kubernetes restarts in its "
                        "pod restores its newest checkpoint saved since the pod started "
                        "(--restore-newest-on-restart, the pod's uid) and the workers replay "
                        "their pushes since: the job goes on, no step redone (sync, "
                        "--replicas 1; a pod recreated, e.g. on another node, starts fresh "
                        "and the workers' replay is refused: --max-restarts restarts the "
                        "job; default 0: off)")
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
    g.add_argument("--warm-starts", choices=WARM_STARTS, default="auto",
                   help="with --max-restarts: each worker pod keeps a process that imported "
                        "TensorFlow, Keras, Horovod and parallax once, and forks each "
                        "attempt's command from it (`python SCRIPT` or `python -m MODULE` "
                        "with the image's Python); auto (default): on, but not on a node "
                        "with NVIDIA GPUs; off: every attempt starts its command cold")
    g.add_argument("--held-backups", type=int, default=0, metavar="N",
                   help="with --max-restarts: Keras BackupAndRestore keeps one backup in N "
                        "on disk and the tables of the others in the servers' memory; the "
                        "servers keep the run's tables across restarts (default 0: every "
                        "backup on disk, the tables dropped before each restart)")


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
                        f"id>); default {DEFAULT_DATA_DIR} with --max-restarts, --replay-mb "
                        "or --data-volume-size, else none")
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
        min_workers=args.min_workers, max_workers=args.max_workers,
        elastic_timeout=args.elastic_timeout,
        servers=args.servers, namespace=args.namespace, mode=args.mode, sync=args.sync,
        replicas=args.replicas, replay_mb=args.replay_mb,
        cluster_domain=args.cluster_domain, server_wait_s=args.server_wait,
        server_port=args.server_port, rendezvous_port=args.rendezvous_port, plan=plan,
        collectives=args.collectives, collective_port=args.collective_port,
        server_args=tuple(args.server_arg), gloo_iface=args.gloo_iface,
        image_pull_policy=args.image_pull_policy, max_restarts=args.max_restarts,
        warm_starts=args.warm_starts, held_backups=args.held_backups,
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
        metrics_pod_labels=tuple(args.metrics_pod_label), patches=tuple(args.patch),
        format=args.format)
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
