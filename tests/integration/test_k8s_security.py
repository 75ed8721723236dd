"""A job rendered by `parallax k8s` is closed to the rest of the cluster by default (issue
27), checked by replaying the attacks against what the project renders and runs:

- the gang coordinator on worker 0, with two real supervisors (`parallax k8s worker`
  processes): made-up ranks, a real rank reporting a failure, no token or a wrong one: all
  refused, and the job keeps running to its own end without a restart;
- the rendered servers' command, run as a real `parallax server`: gRPC, the data plane and
  /metrics refuse a caller without the token; only the kubelet's health check answers;
- the rendered objects: the token Secret mounted as a file into every server and worker, the
  NetworkPolicy admitting only the job's pods (and the named scrapers to the metrics port),
  Pod Security "restricted" contexts, no service account token in worker pods, mutual TLS
  with --secure; `--insecure` renders the open shape and says so.
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from parallax import SGD, TableSpec
from parallax.client import ClientOptions, PSClient
from parallax.env import GANG_TIMEOUT_ENV, READY_PREFIX, RENDEZVOUS_ENV, TOKEN_FILE_ENV
from parallax.errors import ConfigError, ServerError
from parallax.launch import gang, k8s
from parallax.launch import k8s_security as secure
from parallax.launch.k8s import K8sConfig, render
from parallax.launch.restarts import RestartBudget

BIN = Path(sys.executable).parent
TOKEN = "the-jobs-token-0123456789"
CONFIG = K8sConfig(name="ctr", image="parallax", command=("python", "t.py"), workers=2,
                   servers=2, namespace="ml", max_restarts=2, service_monitor=True,
                   metrics_namespaces=("monitoring",), metrics_pod_labels=("app=prom",))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _by_kind(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _pod(objs: dict, kind: str, name: str) -> dict:
    return objs[kind, name]["spec"]["template"]["spec"]


def _container(pod: dict, name: str) -> dict:
    (container,) = [c for c in pod["containers"] if c["name"] == name]
    return container


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


# --------------------------------------------------------------------------- the gang

PROBE = """
import os, sys, time, pathlib
rank, attempt = os.environ["HOROVOD_RANK"], os.environ["PARALLAX_RESTART_COUNT"]
print(f"rank={rank} attempt={attempt}", flush=True)
release = pathlib.Path(os.environ["RELEASE"])
deadline = time.monotonic() + 100
while not release.exists() and time.monotonic() < deadline:
    time.sleep(0.1)
sys.exit(0)
"""


def _gang_request(port: int, method: str, query: str, token: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{gang.PATH}?{query}",
                                     method=method, headers=headers,
                                     data=b"" if method == "PUT" else None)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _start_gang(tmp_path: Path) -> tuple[dict[int, subprocess.Popen], int, Path]:
    """Two worker 'pods' of CONFIG's rendered Job (their env, the token mounted as a file),
    each a real `parallax k8s worker` supervisor running PROBE; worker 0 serves the gang."""
    (job,) = [o for o in render(dataclasses.replace(
        CONFIG, servers=0, mode="allreduce", service_monitor=False, metrics_namespaces=(),
        metrics_pod_labels=())) if o["kind"] == "Job"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "token").write_text(TOKEN + "\n")
    port, release = _free_port(), tmp_path / "release"
    env = {**_env(container), "PATH": f"{BIN}:/usr/bin:/bin", RENDEZVOUS_ENV:
           f"127.0.0.1:{port}", GANG_TIMEOUT_ENV: "20", "RELEASE": str(release),
           TOKEN_FILE_ENV: str(tmp_path / "token"),
           **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}
    assert _env(container)[TOKEN_FILE_ENV] == secure.token_file()  # the Secret's mount
    argv = [str(BIN / "parallax"), "k8s", "worker", "--", sys.executable,
            str(tmp_path / "probe.py")]
    pods = {i: subprocess.Popen(argv, env={**env, "JOB_COMPLETION_INDEX": str(i)},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in (1, 0)}
    return pods, port, release


def _await_running(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            status, body = _gang_request(port, "GET", "rank=0", TOKEN)
            if status == 200 and body["state"] == "running":
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the gang did not start running within 60 s")


@pytest.mark.multiprocess
def test_strangers_cannot_end_fail_or_restart_the_gang(tmp_path):
    """The attack of issue 27: two PUTs with made-up ranks and code 0 marked the gang done
    (every supervisor stopped its command and exited 0, the Job showed Complete); a PUT with
    a real rank and code 1 burnt a restart. Now each is refused, and the job runs on."""
    pods, port, release = _start_gang(tmp_path)
    try:
        _await_running(port)
        attacks = ["rank=1000&attempt=0&code=0", "rank=1001&attempt=0&code=0",
                   "rank=1&attempt=0&code=1", "rank=0&attempt=0&code=0"]
        for query in attacks:
            for token in (None, "guessed", TOKEN[:-1]):
                status, _ = _gang_request(port, "PUT", query, token)
                assert status == 401, (query, token)
            assert _gang_request(port, "GET", query.split("&")[0], None)[0] == 401
        # an insider's malformed requests: refused, not a traceback, nothing recorded
        for query in ("rank=1000&attempt=0&code=0", "rank=-1&attempt=0&code=0",
                      "rank=1&attempt=-1&code=0", "rank=1&attempt=0&code=300",
                      "rank=1&attempt=0", "rank=x&attempt=0&code=0",
                      "rank=1&rank=0&attempt=0&code=0", "rank=--1&attempt=0&code=0",
                      "rank=%C2%B2&attempt=0&code=0", "rank=%D9%A1&attempt=0&code=0",
                      "rank=1&attempt=0&code=" + "9" * 40):
            status, body = _gang_request(port, "PUT", query, TOKEN)
            assert status == 400 and body["error"], (query, body)
        time.sleep(3 * gang.POLL_S)
        assert _gang_request(port, "GET", "rank=0", TOKEN)[1] == {
            "attempt": 0, "state": "running", "code": 0}
        assert all(p.poll() is None for p in pods.values())  # the commands still run
        release.write_text("")  # the job's own end
        outs = {i: p.communicate(timeout=90)[0] for i, p in pods.items()}
    finally:
        for p in pods.values():
            p.kill() if p.poll() is None else None
    for rank, out in outs.items():
        assert pods[rank].returncode == 0, out[-3000:]
        assert f"rank={rank} attempt=0" in out and "attempt=1" not in out  # no restart burnt


@pytest.mark.multiprocess
def test_a_supervisor_without_the_jobs_token_says_so_and_fails(tmp_path):
    """A pod that mounts another token (a mixed-up Secret) fails with the reason, instead
    of waiting out the gang timeout as if worker 0 were gone."""
    port = _free_port()
    coordinator = gang.Gang(2, RestartBudget(0, say=lambda _: None), lambda _: None, 20)
    server = k8s.start_rendezvous(port, 2, "127.0.0.1", coordinator, horovod=False,
                                  token=TOKEN)
    try:
        t0 = time.monotonic()
        code = gang.Supervisor(f"http://127.0.0.1:{port}", 1, ["true"], lambda _: {}, 20,
                               token="another-jobs-token").run()
    finally:
        server.shutdown()
        server.server_close()
    assert code == 1 and time.monotonic() - t0 < 10


def test_the_gang_refuses_ranks_and_attempts_outside_the_job():
    coordinator = gang.Gang(2, RestartBudget(0, say=lambda _: None), lambda _: None)
    for rank in (2, 1000, -1, True):
        with pytest.raises(gang.GangRequestError, match=rf"rank {rank!r} is not a rank"):
            coordinator.poll(rank)
        with pytest.raises(gang.GangRequestError):
            coordinator.report(rank, 0, 0)
    with pytest.raises(gang.GangRequestError, match="attempt -1"):
        coordinator.report(0, -1, 0)
    assert coordinator.seen == {} and coordinator.exits == {} and not coordinator.told


# --------------------------------------------------------------------------- the servers

def _rendered_server(tmp_path: Path, config: K8sConfig,
                     objs: dict | None = None) -> tuple[subprocess.Popen, dict]:
    """The rendered server container's command (of `objs`, else a new rendering) as a real
    process: the Secret's files where the mounts put them are rewritten to files here,
    ports to free ones, the host to loopback; every security flag stays as rendered."""
    objs = objs or _by_kind(render(config))
    server = _container(_pod(objs, "StatefulSet", f"{config.name}-ps"), "server")
    secrets = {name: obj["stringData"] for (kind, name), obj in objs.items() if kind == "Secret"}
    mounts = {}
    for mount in server["volumeMounts"]:
        volume = next(v for v in _pod(objs, "StatefulSet", f"{config.name}-ps")["volumes"]
                      if v["name"] == mount["name"])
        if "secret" in volume:
            here = tmp_path / mount["name"]
            here.mkdir()
            for key, value in secrets[volume["secret"]["secretName"]].items():
                (here / key).write_text(value)
            mounts[mount["mountPath"]] = str(here)
    ports = {"--port": _free_port(), "--data-port": _free_port(), "--metrics-port": _free_port()}
    argv = list(server["command"])
    for i in range(len(argv)):
        if argv[i - 1] in ports:
            argv[i] = str(ports[argv[i - 1]])
        elif argv[i - 1] in ("--host", "--metrics-host"):
            argv[i] = "127.0.0.1"
        elif argv[i - 1] == "--data-dir":
            argv[i] = str(tmp_path / "data")
        for mounted, here in mounts.items():
            argv[i] = argv[i].replace(mounted, here)
    proc = subprocess.Popen([str(BIN / argv[0]), *argv[1:]], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)  # (its log: stderr)
    _ready_line(proc)
    return proc, {"grpc": ports["--port"], "metrics": ports["--metrics-port"],
                  "token": secrets[f"{config.name}-token"]["token"], "mounts": mounts}


def _ready_line(proc: subprocess.Popen, timeout: float = 60) -> str:
    """The server's READY line (its first line on stdout), within `timeout`."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if READY_PREFIX not in line:
        proc.kill()
        raise AssertionError(f"the rendered server did not say it was ready within "
                             f"{timeout:g} s: {line!r} (exit {proc.wait()})")
    return line


@pytest.mark.multiprocess
def test_the_rendered_servers_refuse_every_port_to_a_caller_without_the_token(tmp_path):
    proc, server = _rendered_server(tmp_path, CONFIG)
    address = f"127.0.0.1:{server['grpc']}"
    spec = TableSpec(name="ctr.v0.emb", vocabulary_size=16, dim=2, optimizer=SGD(0.1))
    try:
        with PSClient([address], ClientOptions(token=server["token"], timeout=10)) as owner:
            owner.wait_ready(20)
            owner.create_table(spec)
            owner.table(spec).pull([1, 2])  # the job itself gets in (data plane and gRPC)
        for token in (None, "guessed"):
            with PSClient([address], ClientOptions(token=token, timeout=5, retries=0)) as c:
                table = c.table(spec)
                for call in (c.stats, lambda t=table: t.pull([1]),  # gRPC; the data plane
                             lambda t=table: t.push([1], np.ones((1, 2)), step=0),
                             lambda c=c: c.delete_tables("ctr.")):
                    with pytest.raises(ServerError) as info:
                        call()
                    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED, info.value
            request = urllib.request.Request(
                f"http://127.0.0.1:{server['metrics']}/metrics",
                headers={"Authorization": f"Bearer {token}"} if token else {})
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(request, timeout=10)
            assert info.value.code == 401
        # only the kubelet's probe answers without the token, and only SERVING: not Watch,
        # not reflection, not a look-alike name
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as info:
                next(health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(), timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for method in ("/grpc.health.v1.Health/Check/", "/grpc.health.v1.health/Check",
                           "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
                call = channel.unary_unary(method, request_serializer=bytes,
                                           response_deserializer=bytes)
                with pytest.raises(grpc.RpcError) as info:
                    call(b"", timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        with PSClient([address], ClientOptions(token=server["token"], timeout=10)) as owner:
            np.testing.assert_array_equal(owner.table(spec).pull([1]), np.zeros((1, 2)))
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.multiprocess
def test_secure_renders_mutual_tls_that_the_servers_demand(tmp_path):
    config = dataclasses.replace(CONFIG, secure=True)
    objs = _by_kind(render(config))
    names = secure.server_names(config)
    cert = x509.load_pem_x509_certificate(
        objs["Secret", "ctr-tls-server"]["stringData"]["server.pem"].encode())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.DNSName)) == set(names)
    worker = _container(_pod(objs, "Job", "ctr-worker"), "worker")
    addresses = _env(worker)["PARALLAX_PS_ADDRESSES"].split(",")
    assert {a.rsplit(":", 1)[0] for a in addresses} <= set(names)  # what workers dial
    assert "server.key" not in str(objs["Secret", "ctr-tls-client"])  # workers: no server key
    assert "client.key" not in str(objs["Secret", "ctr-tls-server"])
    sts = _pod(objs, "StatefulSet", "ctr-ps")
    assert "tcpSocket" in _container(sts, "server")["readinessProbe"]  # gRPC probes: no TLS
    proc, server = _rendered_server(tmp_path, config, objs)
    try:
        address = f"127.0.0.1:{server['grpc']}"
        files = Path(server["mounts"][secure.TLS_DIR])
        with PSClient([address], ClientOptions(token=server["token"], timeout=5,
                                               retries=0)) as plain:
            with pytest.raises(ServerError) as info:
                plain.stats()  # plain text against TLS
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        # what a worker of the job holds: the CA, its client certificate and the token; the
        # server's certificate names the servers' DNS names (dialled here by override)
        ca = (files / "ca.pem").read_bytes()
        worker_files = {k: v.encode() for k, v in
                        objs["Secret", "ctr-tls-client"]["stringData"].items()}
        with_cert = grpc.ssl_channel_credentials(ca, worker_files["client.key"],
                                                 worker_files["client.pem"])
        assert _health(address, with_cert, names[0], server["token"]) == "SERVING"
        assert _health(address, with_cert, names[0], None) == "UNAUTHENTICATED"
        without_cert = grpc.ssl_channel_credentials(ca)
        assert _health(address, without_cert, names[0], server["token"]) == "UNAVAILABLE"
    finally:
        proc.terminate()
        proc.wait(30)


def _health(address: str, credentials, name: str, token: str | None) -> str:
    """grpc.health.v1 Check over `credentials` as server `name`: the status, or the error
    code's name."""
    options = [("grpc.ssl_target_name_override", name)]
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.secure_channel(address, credentials, options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10, metadata=metadata)
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


# --------------------------------------------------------------------------- the manifests

def test_every_server_and_worker_mounts_the_token_as_a_file_never_an_env_value():
    objects = render(CONFIG)
    objs = _by_kind(objects)
    kinds = [o["kind"] for o in objects]
    assert kinds.index("Secret") < kinds.index("StatefulSet")  # before the pods need it
    token = objs["Secret", "ctr-token"]["stringData"]["token"]
    assert len(token) >= 40 and render(CONFIG)[1]["stringData"]["token"] != token  # random
    for kind, name, container_name in (("StatefulSet", "ctr-ps", "server"),
                                       ("Job", "ctr-worker", "worker")):
        pod = _pod(objs, kind, name)
        container = _container(pod, container_name)
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "parallax-token"]
        assert mount["readOnly"] and mount["mountPath"] == secure.TOKEN_DIR
        (volume,) = [v for v in pod["volumes"] if v["name"] == "parallax-token"]
        assert volume["secret"] == {"secretName": "ctr-token", "defaultMode": 0o440}
        assert token not in json.dumps(pod)  # the value is in the Secret alone
    from parallax_ps.server import parse_args
    server = _container(_pod(objs, "StatefulSet", "ctr-ps"), "server")
    parsed = parse_args(server["command"][2:])  # the server's own parser
    assert str(parsed.token_file) == secure.token_file() and parsed.health_without_token
    assert parsed.metrics_port and parsed.data_port  # both behind that token (the server's)
    worker = _container(_pod(objs, "Job", "ctr-worker"), "worker")
    assert _env(worker)[TOKEN_FILE_ENV] == secure.token_file()
    watcher = _container(_pod(objs, "StatefulSet", "ctr-ps"), "job-watch")
    assert "parallax-token" not in str(watcher)  # the watcher needs no job token
    own = dataclasses.replace(CONFIG, token_secret="team-token")
    own_objs = _by_kind(render(own))
    assert ("Secret", "ctr-token") not in own_objs
    assert "team-token" in json.dumps(_pod(own_objs, "Job", "ctr-worker"))


def test_only_the_jobs_pods_and_the_named_scrapers_get_in():
    objs = _by_kind(render(CONFIG))
    job_pods = {"matchLabels": {k8s.LABEL_JOB: "ctr"}}
    policy = objs["NetworkPolicy", "ctr"]["spec"]
    assert policy == {"podSelector": job_pods, "policyTypes": ["Ingress"],
                      "ingress": [{"from": [{"podSelector": job_pods}]}]}
    for kind, name in (("StatefulSet", "ctr-ps"), ("Job", "ctr-worker")):
        labels = objs[kind, name]["spec"]["template"]["metadata"]["labels"]
        assert labels[k8s.LABEL_JOB] == "ctr"  # the policy covers servers and workers
    metrics = objs["NetworkPolicy", "ctr-metrics"]["spec"]
    assert metrics["podSelector"]["matchLabels"][k8s.LABEL_ROLE] == "ps"
    (rule,) = metrics["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": k8s.server_metrics_port(CONFIG)}]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
        {"podSelector": {"matchLabels": {"app": "prom"}}}]
    monitor = objs["ServiceMonitor", "ctr-ps"]["spec"]["endpoints"][0]
    assert monitor["authorization"]["credentials"] == {"name": "ctr-token", "key": "token"}
    plain = _by_kind(render(dataclasses.replace(CONFIG, metrics_namespaces=(),
                                                metrics_pod_labels=(), service_monitor=False)))
    assert ("NetworkPolicy", "ctr") in plain and ("NetworkPolicy", "ctr-metrics") not in plain


def test_every_pod_meets_pod_security_restricted():
    for config in (CONFIG, dataclasses.replace(CONFIG, secure=True, data_volume_size="1Gi"),
                   dataclasses.replace(CONFIG, keep_servers=True, max_restarts=0)):
        objs = _by_kind(render(config))
        pods = [_pod(objs, kind, name) for kind, name in objs if kind in ("StatefulSet", "Job")]
        assert len(pods) == 2
        for pod in pods:
            context = pod["securityContext"]
            assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}
            for container in pod["containers"]:
                assert container["securityContext"] == {
                    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
            allowed = {"configMap", "secret", "emptyDir", "projected", "persistentVolumeClaim"}
            for volume in pod.get("volumes", []):
                assert set(volume) - {"name"} <= allowed, volume  # restricted's volume types
        worker_pod = _pod(objs, "Job", "ctr-worker")
        assert worker_pod["automountServiceAccountToken"] is False


def test_insecure_renders_the_open_shape_and_says_so(tmp_path, capsys):
    opened = dataclasses.replace(CONFIG, insecure=True, metrics_namespaces=(),
                                 metrics_pod_labels=())
    objects = render(opened)
    kinds = {o["kind"] for o in objects}
    assert not kinds & {"Secret", "NetworkPolicy"}
    text = json.dumps(objects)
    for word in ("--token-file", TOKEN_FILE_ENV, "securityContext\": {\"runAsNonRoot",
                 "allowPrivilegeEscalation", "\"authorization\":"):
        assert word not in text
    argv = ["--name", "ctr", "--image", "x", "--insecure", "--", "python", "t.py"]
    assert k8s.main(argv) == 0
    out, err = capsys.readouterr()
    assert "--insecure" in err and "any pod in the cluster" in err
    assert out.startswith("# parallax k8s --insecure")
    assert [o["kind"] for o in yaml.safe_load_all(out)][:2] == ["ConfigMap", "ServiceAccount"]


@pytest.mark.parametrize("changes, words", [
    ({"insecure": True, "secure": True}, ["--insecure", "--secure", "drop one"]),
    ({"insecure": True, "token_secret": "t"}, ["--insecure", "--token-secret"]),
    ({"insecure": True, "metrics_namespaces": ("m",)}, ["--metrics-namespace"]),
    ({"token_secret": "Team_Token"}, ["--token-secret 'Team_Token'", "Secret name"]),
    ({"secure": True, "servers": 0, "mode": "allreduce"}, ["--secure", "--servers is 0"]),
    ({"metrics_namespaces": ("Monitoring",)}, ["--metrics-namespace 'Monitoring'"]),
    ({"metrics_pod_labels": ("app",)}, ["--metrics-pod-label 'app'", "KEY=VALUE"]),
    ({"server_args": ("--token-file=/x",)}, ["--server-arg '--token-file=/x'",
                                             "--token-secret"]),
    ({"server_args": ("--health-without-token",)}, ["--server-arg"]),
    ({"service_monitor": True}, ["--service-monitor", "NetworkPolicy",
                                 "--metrics-namespace NS"]),
    ({"metrics_namespaces": ("m",), "servers": 0, "mode": "allreduce"},
     ["--metrics-namespace", "--servers is 0"]),
    ({"metrics_pod_labels": ("app=p",), "metrics_port": 0}, ["--metrics-port is 0"]),
])
def test_bad_security_settings_are_refused_with_the_fix(changes, words):
    fields = dict(name="job", image="parallax", command=("python", "t.py"), workers=2)
    with pytest.raises(ConfigError) as info:
        render(K8sConfig(**{**fields, **changes}))
    for word in words:
        assert word in str(info.value)


def test_cli_security_flags_reach_the_config():
    config, _ = k8s.config_from_args([
        "--name", "s", "--image", "x", "--secure", "--token-secret", "team-token",
        "--metrics-namespace", "monitoring", "--metrics-pod-label", "app=prom", "--",
        "python", "t.py"])
    assert (config.secure, config.token_secret, config.insecure) == (True, "team-token", False)
    assert config.metrics_namespaces == ("monitoring",)
    assert config.metrics_pod_labels == ("app=prom",)


def test_a_server_refuses_health_without_token_alone(capsys):
    from parallax_ps.server import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--health-without-token"])
    assert "give --token-file too" in capsys.readouterr().err


def test_a_token_is_printable_ascii(tmp_path):
    from parallax.protocol.security import read_token
    path = tmp_path / "token"
    for bad in ("caf\u00e9", "10\u20ac", "two words"):
        path.write_text(bad)
        with pytest.raises(ConfigError, match="printable ASCII"):
            read_token(path)


@pytest.mark.multiprocess
def test_the_rendezvous_store_bounds_what_a_stranger_can_cost(capfd):
    """Horovod's store (gloo cannot send a token; the NetworkPolicy guards it): no file of
    the working directory is served, a value and the store are capped, and peers that hang
    up early leave no traceback."""
    from parallax.launch import rendezvous
    port = _free_port()
    server = k8s.start_rendezvous(port, 2, "127.0.0.1")
    base = f"http://127.0.0.1:{port}"

    def put(path: str, body: bytes) -> int:
        request = urllib.request.Request(base + path, data=body, method="PUT")
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status
        except urllib.error.HTTPError as err:
            return err.code
    try:
        head = urllib.request.Request(f"{base}/README.md", method="HEAD")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(head, timeout=10)
        assert info.value.code == 405
        assert put("/global/0", b"10.0.0.1:1234") == 200  # what a rank stores
        assert put("/global/1", b"x" * (rendezvous.MAX_VALUE_BYTES + 1)) == 413
        for i in range(rendezvous.MAX_STORE_BYTES // rendezvous.MAX_VALUE_BYTES - 1):
            assert put(f"/junk/{i}", b"x" * rendezvous.MAX_VALUE_BYTES) == 200
        assert put("/junk/last", b"x" * rendezvous.MAX_VALUE_BYTES) == 507
        for _ in range(50):  # hang up before the answer
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"GET /global/0 HTTP/1.1\r\nHost: x\r\n\r\n")
        with urllib.request.urlopen(f"{base}/global/0", timeout=10) as reply:
            assert reply.read() == b"10.0.0.1:1234"
    finally:
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capfd.readouterr().err
