"""Containers and clusters: the Dockerfile's layers (dependencies before the source, a slim
runtime stage), deploy/docker-compose.yml is a consistent local cluster, `parallax k8s` renders
valid manifests, its worker bootstrap forms a real Horovod gloo job without horovodrun, and its
servers' job watcher ends them with the Job.

No Docker engine or Kubernetes cluster runs here: the Dockerfile and compose file are checked
by parsing them (`make image` builds and smoke-tests the image with podman, too slow for CI),
the manifests against Kubernetes' JSON schemas (kubernetes-validate, bundled offline) and
structurally; the worker bootstrap runs for real, as two processes on loopback; the job
watcher talks to a fake API server over TLS on loopback.
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from parallax import cli
from parallax.env import (ADDRESSES_ENV, CONNECT_TIMEOUT_ENV, GANG_TIMEOUT_ENV, HELD_BACKUPS_ENV,
                          JOB_CONFIG_ENV, MAX_RESTARTS_ENV, RENDEZVOUS_ENV, RENDEZVOUS_TIMEOUT_ENV,
                          TOKEN_FILE_ENV, strategy_options)
from parallax.errors import ConfigError
from parallax.launch import k8s
from parallax.launch.k8s import MIN_KUBERNETES, K8sConfig, render
from parallax.launch.run import parse_args

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# The oldest release the manifests target (k8s.MIN_KUBERNETES: 1.28's Job schema still
# required podFailurePolicy rules to name onPodConditions) and the newest with schemas here.
K8S_VERSIONS = (f"{MIN_KUBERNETES}.0", "1.37.0")


# --------------------------------------------------------------------------- Dockerfile
# The image is built in layers that change as rarely as possible (issue 14): a builder stage
# `deps` copies only the dependency manifests and fills the venv (TF, Keras, Horovod with
# gloo) before any source; the default stage `runtime` holds the venv, the source and
# parallax, and no compiler, sshd or test extras. `make image` builds and smoke-tests it
# (scripts/build_image.sh); these tests check the rules by parsing.

MANIFESTS = {"requirements/base.txt", "setup.cfg", "pyproject.toml"}
SOURCE = {"parallax", "servers", "examples"}


def _dockerfile():
    dockerfile_parse = pytest.importorskip("dockerfile_parse")
    parser = dockerfile_parse.DockerfileParser(path=str(ROOT / "Dockerfile"))
    return parser.structure


def _instructions(name: str) -> list[str]:
    return [i["value"] for i in _dockerfile() if i["instruction"] == name]


def _stages() -> tuple[list[str], dict[str, dict]]:
    """The global ARGs, and each stage by name: its parent (FROM) and its instructions."""
    global_args, stages, current = [], {}, None
    for ins in _dockerfile():
        if ins["instruction"] == "FROM":
            parent, _, name = re.match(r"^(\S+)(\s+AS\s+(\S+))?$", ins["value"], re.I).groups()
            current = stages.setdefault(name, {"parent": parent, "ins": []})
        elif current is None:
            if ins["instruction"] == "ARG":
                global_args.append(ins["value"])
        elif ins["instruction"] != "COMMENT":
            current["ins"].append((ins["instruction"], ins["value"]))
    return global_args, stages


def _chain(stages: dict, name: str) -> list[str]:
    """The stage and the stages it is built FROM, itself first."""
    chain = [name]
    while stages[chain[-1]]["parent"] in stages:
        chain.append(stages[chain[-1]]["parent"])
    return chain


def _copy(value: str) -> tuple[dict, list[str], str]:
    """A COPY's --flags, sources and destination."""
    words = value.split()
    flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
    paths = [w for w in words if not w.startswith("--")]
    return flags, paths[:-1], paths[-1]


def _runtime() -> tuple[dict, list[tuple[str, str]]]:
    """The stages, and the default target's instructions with those of its ancestors."""
    _, stages = _stages()
    last = list(stages)[-1]
    return stages, [i for s in reversed(_chain(stages, last)) for i in stages[s]["ins"]]


def test_dockerfile_base_image_is_a_build_arg_with_a_python_tensorflow_supports():
    global_args, stages = _stages()
    args = dict(a.split("=", 1) for a in global_args if "=" in a)
    match = re.match(r"^python:3\.(\d+)(-[a-z-]+)?$", args["BASE"])
    assert match and 10 <= int(match.group(1)) <= 12, args  # TF 2.17.1 needs 3.10-3.12
    roots = {stages[_chain(stages, name)[-1]]["parent"] for name in stages}
    # every stage starts from the one base (the venv links to that interpreter)
    assert roots == {"${BASE}"}, roots


def test_dockerfile_is_multi_stage_and_the_default_is_the_slim_runtime():
    _, stages = _stages()
    assert len(stages) >= 2 and "deps" in stages
    last = list(stages)[-1]
    assert last == "runtime", "the default target (the last stage) is the runtime"
    chain = _chain(stages, last)
    assert "deps" not in chain  # the builder's compilers stay behind
    _, instructions = _runtime()
    from_deps = [_copy(v) for k, v in instructions if k == "COPY" and "--from=deps" in v]
    assert [(paths, dest) for _, paths, dest in from_deps] == [(["/opt/venv"], "/opt/venv")]


def test_dockerfile_installs_dependencies_before_the_source():
    _, stages = _stages()
    deps = stages["deps"]["ins"]
    copied = [p for k, v in deps if k == "COPY" for p in _copy(v)[1]]
    assert set(copied) == MANIFESTS, copied  # the builder sees only the manifests
    runs = [(i, v) for i, (k, v) in enumerate(deps) if k == "RUN"]
    where = {name: next(i for i, (k, v) in enumerate(deps) if k == "COPY" and name in v)
             for name in MANIFESTS}
    horovod = next(i for i, v in runs if "horovod==" in v)
    base = next(i for i, v in runs if "-r requirements/base.txt" in v)
    project = next(i for i, v in runs if "setup.cfg" in v and "install_requires" in v)
    # TF before Horovod (built against it) before the project's requirements; Horovod's layer
    # depends on requirements/base.txt alone, so an edit of setup.cfg does not rebuild it
    assert where["requirements/base.txt"] < base < horovod < where["setup.cfg"] < project
    # nothing moves what Horovod was built against
    assert "pip freeze" in deps[project][1] and re.search(r"pip install -c \S+", deps[project][1])

    _, runtime = _runtime()
    venv = next(i for i, (k, v) in enumerate(runtime) if k == "COPY" and "--from=deps" in v)
    sources = [(i, p) for i, (k, v) in enumerate(runtime) if k == "COPY" and "--from" not in v
               for p in _copy(v)[1]]
    assert SOURCE <= {p for _, p in sources}, sources
    assert all(i > venv for i, _ in sources), "the venv layer comes before the source"
    (install,) = [(i, v) for i, (k, v) in enumerate(runtime)
                  if k == "RUN" and re.search(r"pip[0-9.]* install", v)]
    assert install[0] > max(i for i, _ in sources)
    # parallax itself: editable (as `make env`; the demo runs examples/ from the source), from
    # what is there: no index, no dependencies, no build tools fetched
    for flag in ("--no-index", "--no-deps", "--no-build-isolation", "-e ."):
        assert flag in install[1], (flag, install[1])
    assert not [v for v in _instructions("COPY") if "." in _copy(v)[1]], "no COPY of everything"


def test_dockerfile_builds_horovod_as_setup_env_does():
    setup_env = (ROOT / "scripts" / "setup_env.sh").read_text()
    _, stages = _stages()
    (build,) = [v for k, v in stages["deps"]["ins"] if k == "RUN" and "horovod==" in v]
    version = re.search(r"horovod==([0-9.]+)", setup_env).group(1)
    assert f"horovod=={version}" in build
    flags = set(re.findall(r"\bHOROVOD_[A-Z_]+=1", setup_env))
    assert flags and flags == set(re.findall(r"\bHOROVOD_[A-Z_]+=1", build)), flags
    assert "--no-build-isolation" in build and "hvd.gloo_built()" in build
    assert "/opt/venv/bin/pip install -r requirements/base.txt" in " ".join(
        v for k, v in stages["deps"]["ins"] if k == "RUN")


def test_dockerfile_runtime_is_slim():
    _, instructions = _runtime()
    runs = " && ".join(v for k, v in instructions if k == "RUN")
    installs = " ".join(re.findall(r"apt-get install[^&]*", runs))
    assert re.search(r"\bwordnet-base\b", installs), "the LM example's corpus"
    for package in ("g++", "gcc", "make", "build-essential", "openssh-server",
                    "openssh-client", "git"):
        assert not re.search(rf"(^|\s){re.escape(package)}(\s|$)", installs), package
    assert not re.search(r"\[[^]]*(test|bench)[^]]*\]|pytest|matplotlib", runs), runs
    assert "setup_env.sh" not in runs  # it installs sshd and the test/bench extras
    # the build-only and test-only tools of requirements/base.txt leave the venv it copies
    _, stages = _stages()
    uninstall = " ".join(v for k, v in stages["deps"]["ins"] if k == "RUN"
                         and "pip uninstall" in v)
    for tool in ("cmake", "grpcio-tools", "pytest"):
        assert re.search(rf"\b{tool}\b", uninstall), tool
    assert re.search(r"rm -rf \S*/site-packages/tensorflow/include\b", uninstall)  # C++ headers


def test_dockerfile_ssh_is_a_separate_target():
    _, stages = _stages()
    runs = " ".join(v for k, v in stages.get("ssh", {"ins": []})["ins"] if k == "RUN")
    assert "openssh-server" in runs and "openssh-client" in runs
    assert list(stages)[-1] != "ssh" and "ssh" not in _chain(stages, list(stages)[-1])
    assert re.search(r"rm -rf[^&]*/etc/ssh/ssh_host_", runs), "no host keys baked in"


def test_dockerfile_pip_configuration_is_a_secret():
    _, stages = _stages()
    for name, stage in stages.items():
        for kind, value in stage["ins"]:
            if kind == "RUN" and re.search(r"pip install (?!.*--no-index)", value):
                assert "--mount=type=secret,id=pipconf" in value, value
                assert "--mount=type=secret,id=pipca" in value, value
            if kind in ("COPY", "ADD"):
                assert "pip.conf" not in value and ".pem" not in value and ".crt" not in value
    _, runtime = _runtime()
    env = " ".join(v for k, v in runtime if k in ("ENV", "ARG"))
    assert "PIP_CONFIG_FILE" not in env and "PIP_CERT" not in env and "/run/secrets" not in env


def test_dockerfile_copies_exist_and_are_not_ignored():
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    copied = [p for v in _instructions("COPY") if "--from" not in v for p in _copy(v)[1]]
    needed = copied + ["parallax/__init__.py", "servers/parallax_ps/server.py",
                       "examples/language_model.py", "README.md", "LICENSE"]
    for path in needed:
        assert (ROOT / path).exists(), path
        parts = Path(path).parts
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        hit = [p for p in ignored for pre in prefixes
               if fnmatch.fnmatch(pre, p.lstrip("/")) or fnmatch.fnmatch(pre, p.replace("**/", ""))]
        assert not hit, f"{path} is excluded from the build context by .dockerignore {hit}"
    for path in (".venv", ".git", "bench-results", "**/__pycache__", "*.egg-info"):
        assert path in ignored, path


def test_dockerfile_runtime_settings():
    (entrypoint,) = _instructions("ENTRYPOINT")
    assert json.loads(entrypoint) == ["parallax"]
    _, runtime = _runtime()
    runs = " ".join(v for k, v in runtime if k == "RUN")
    users = [v for k, v in runtime if k == "USER"]
    assert users and users[-1] not in ("root", "0")  # the default target runs as non-root
    assert re.search(rf"useradd\b.*--uid {users[-1]}\b", runs)
    env = " ".join(v for k, v in runtime if k == "ENV")
    assert "PATH=/opt/venv/bin:" in env  # the venv the deps stage filled
    exposed = " ".join(v for k, v in runtime if k == "EXPOSE").split()
    # gRPC, the data plane, metrics, the rendezvous: the ports `parallax k8s` and compose use
    config = K8sConfig(name="x", image="x", command=("t",))
    expected = {config.server_port, config.server_port + 1, k8s.server_metrics_port(config),
                config.rendezvous_port}
    assert {int(p) for p in exposed} == expected == {7000, 7001, 7002, 7070}


def test_make_image_builds_and_smoke_tests_with_the_readme():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^image:.*\n\tbash scripts/build_image\.sh$", makefile, re.M)
    script = (ROOT / "scripts" / "build_image.sh").read_text()
    assert "podman build" in script and "--isolation chroot" in script
    for step in ("podman create", "podman mount", "chroot", "--version", "horovod.tensorflow",
                 "demo", "--secret"):
        assert step in script, step
    guide = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "make image" in guide and "--target ssh" in guide


# --------------------------------------------------------------------------- compose

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())


def _server_port(command: list[str]) -> int:
    assert command[:1] == ["server"], command
    args = dict(zip(command[1::2], command[2::2]))
    assert args["--host"] == "0.0.0.0"  # reachable from the other containers
    return int(args["--port"])


def test_compose_services_are_consistent(compose):
    services = compose["services"]
    servers = {name: s for name, s in services.items() if s["command"][0] == "server"}
    assert sorted(servers) == ["ps0", "ps1"]
    images = {s["image"] for s in services.values()}
    assert len(images) == 1, images  # one image for every service
    builders = [s for s in services.values() if "build" in s]
    assert len(builders) == 1
    context = (ROOT / "deploy" / builders[0]["build"]["context"]).resolve()
    assert context == ROOT and (context / builders[0]["build"]["dockerfile"]).is_file()

    ports = {}
    for name, server in servers.items():
        ports[name] = _server_port(server["command"])
        assert str(ports[name]) in [str(p) for p in server["expose"]]
        check = server["healthcheck"]["test"]
        assert check[0] == "CMD" and check[1] == "parallax" and check[2] in cli.COMMANDS
        assert f"localhost:{ports[name]}" in check

    worker = services["worker"]
    assert worker["command"][0] == "run"
    config = parse_args(worker["command"][1:])  # the real `parallax run` argument parser
    assert config.num_workers == 2 and config.num_servers == 0
    assert sorted(config.ps_addresses) == sorted(f"{n}:{p}" for n, p in ports.items())
    assert config.command[:2] == ("python", "examples/language_model.py")
    assert (ROOT / config.command[1]).is_file()  # the image's WORKDIR is the repository
    for name in servers:
        assert worker["depends_on"][name]["condition"] == "service_healthy"


# --------------------------------------------------------------------------- k8s render

CONFIGS = {
    "hybrid-4x2": K8sConfig(name="wordlm", image="registry.example.com/parallax:0.1",
                            command=("python", "examples/language_model.py", "--epochs", "3"),
                            workers=4, servers=2, namespace="ml", cpu="2", memory="4Gi",
                            plan={"shards": 4, "placement": {"dense/kernel": "ps"}}),
    "ps-1x3-async": K8sConfig(name="ctr-7", image="parallax", command=("python", "train.py"),
                              workers=1, servers=3, mode="ps", sync=False, server_port=9000,
                              server_args=("--threads=32",)),
    "allreduce-no-servers": K8sConfig(name="mlp", image="parallax", workers=2, servers=0,
                                      mode="allreduce", command=("python", "dense.py")),
    "restarts-4x2-pvc": K8sConfig(name="ctr", image="parallax", command=("python", "t.py"),
                                  workers=4, servers=2, max_restarts=3, data_dir="/ckpt",
                                  data_volume_size="10Gi", storage_class="fast-ssd",
                                  server_args=("--threads=32",)),
    "restarts-1x1-emptydir": K8sConfig(name="one", image="parallax", workers=1, servers=1,
                                       command=("python", "t.py"), max_restarts=2),
    "keep-servers": K8sConfig(name="kept", image="parallax", command=("t",),
                              keep_servers=True, server_port=9000, metrics_port=0),
    "monitored-pvc": K8sConfig(name="mon", image="parallax", command=("python", "t.py"),
                               workers=2, service_monitor=True, data_volume_size="1Gi",
                               service_monitor_labels=("release=prometheus",),
                               metrics_namespaces=("monitoring",)),
    "tensorflow-3x2": K8sConfig(name="tf21", image="parallax:tf-2.21", command=("python", "t.py"),
                                workers=3, servers=2, collectives="tensorflow",
                                collective_port=7090),
    "tensorflow-restarts-2x1": K8sConfig(name="tfr", image="parallax", command=("t",),
                                         workers=2, servers=1, collectives="tensorflow",
                                         max_restarts=2),
    "gpu-scheduled": K8sConfig(
        name="gpu", image="parallax", command=("python", "t.py"), workers=2, servers=2,
        cpu="1", memory="2Gi", cpu_limit="2", memory_limit="4Gi", server_cpu="4",
        server_cpu_limit="8", server_memory="16Gi", server_memory_limit="16Gi", gpus=1,
        worker_node_selector=("cloud.google.com/gke-nodepool=gpu-pool",),
        worker_tolerations=("nvidia.com/gpu=present:NoSchedule", "dedicated"),
        server_node_selector=("pool=highmem", "zone="),
        server_tolerations=("highmem:NoExecute",)),
    "secure-mtls-scraped": K8sConfig(name="sec", image="parallax", command=("t",), workers=2,
                                     secure=True, service_monitor=True, max_restarts=1,
                                     metrics_namespaces=("monitoring",),
                                     metrics_pod_labels=("app=prometheus",)),
    "insecure-own-shape": K8sConfig(name="open", image="parallax", command=("t",), workers=2,
                                    insecure=True, max_restarts=1),
    "replicas-3x3": K8sConfig(name="rep", image="parallax", command=("python", "t.py"),
                              workers=3, servers=3, replicas=2, max_restarts=1),
}
RESTART_CONFIGS = sorted(k for k in CONFIGS if CONFIGS[k].max_restarts)


def _python_path(*first: Path) -> dict[str, str]:
    """PYTHONPATH: `first`, then the checkout the tests run against where it is not the
    installed one."""
    paths = [*map(str, first), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths)} if paths else {}


def _without_horovod(tmp_path: Path) -> dict[str, str]:
    """The environment of an image without Horovod: `import horovod` fails."""
    fake = tmp_path / "no-horovod" / "horovod"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text("raise ImportError('no Horovod in this image')\n")
    return _python_path(fake.parent)


def _by_kind(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _container(controller: dict, name: str) -> dict:
    (container,) = [c for c in controller["spec"]["template"]["spec"]["containers"]
                    if c["name"] == name]
    return container


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_manifests_are_structurally_valid(key):
    config = CONFIGS[key]
    objects = render(config)
    text = k8s.dump(objects)
    assert "&id" not in text and "*id" not in text  # no YAML anchors
    assert list(yaml.safe_load_all(text)) == objects
    names = set()
    for obj in objects:
        assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"]
        assert DNS_1123.match(obj["metadata"]["name"]) and len(obj["metadata"]["name"]) <= 63
        assert obj["metadata"]["namespace"] == config.namespace
        assert obj["metadata"]["labels"][k8s.LABEL_JOB] == config.name
        names.add((obj["kind"], obj["metadata"]["name"]))
        spec = obj.get("spec", {})
        if "template" in spec:  # controllers: the selector (if any) matches the pod labels
            labels = spec["template"]["metadata"]["labels"]
            for k, v in spec.get("selector", {}).get("matchLabels", {}).items():
                assert labels[k] == v
    assert len(names) == len(objects)

    objs = _by_kind(objects)
    n, s = config.workers, config.servers
    # ConfigMap
    job = json.loads(objs["ConfigMap", f"{config.name}-config"]["data"]["job.json"])
    assert job["mode"] == config.mode and job["sync"] == config.sync
    assert job["workers"] == n and job["servers"] == s and job["run_id"] == config.name
    assert job["plan"] == dict(config.plan) and job["command"] == list(config.command)
    # servers
    if s:
        svc = objs["Service", f"{config.name}-ps"]
        sts = objs["StatefulSet", f"{config.name}-ps"]
        assert svc["spec"]["clusterIP"] == "None"
        metrics = k8s.server_metrics_port(config)
        assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == \
            [("grpc", config.server_port)] + ([("metrics", metrics)] if metrics else [])
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert all(pod_labels[k] == v for k, v in svc["spec"]["selector"].items())
        assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
        assert sts["spec"]["replicas"] == s
        server = _container(sts, "server")
        assert server["command"][:2] == ["parallax", "server"]
        args = server["command"]
        assert args[args.index("--port") + 1] == str(config.server_port)
        assert args[args.index("--host") + 1] == "0.0.0.0"
        # gRPC, the data plane (PullMany/PushMany frames) on the port after it, and metrics
        assert [p["containerPort"] for p in server["ports"]] == [
            config.server_port, config.server_port + 1] + ([metrics] if metrics else [])
        assert args[args.index("--data-port") + 1] == str(config.server_port + 1)
        probe = server["readinessProbe"]  # TLS (--secure): the kubelet cannot speak gRPC
        assert probe["tcpSocket" if config.secure else "grpc"]["port"] == config.server_port
        assert tuple(args[6:6 + len(config.server_args)]) == config.server_args
    else:
        assert not any(kind == "StatefulSet" for kind, _ in objs)
    # workers
    job_obj = objs["Job", f"{config.name}-worker"]
    spec = job_obj["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == n
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    workers_svc = objs["Service", pod["subdomain"]]
    assert workers_svc["spec"]["clusterIP"] == "None"
    labels = spec["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in workers_svc["spec"]["selector"].items())
    (worker,) = pod["containers"]
    assert worker["command"] == ["parallax", "k8s", "worker", "--", *config.command]
    env = _env(worker)
    assert env["PARALLAX_RUN_ID"] == config.name and env["PARALLAX_MODE"] == config.mode
    assert env["PARALLAX_SYNC"] == ("sync" if config.sync else "async")
    if s:
        addresses = env["PARALLAX_PS_ADDRESSES"].split(",")
        assert addresses == [f"{config.name}-ps-{i}.{config.name}-ps.{config.namespace}"
                             f".svc.cluster.local:{config.server_port}" for i in range(s)]
        assert job["ps_addresses"] == addresses
    else:
        assert "PARALLAX_PS_ADDRESSES" not in env
    if n > 1 and config.collectives == "tensorflow":  # each pod's TensorFlow server, by rank
        assert not any(k.startswith("HOROVOD_") for k in env)
        assert env["PARALLAX_WORKERS"].split(",") == [
            f"{job_obj['metadata']['name']}-{i}.{pod['subdomain']}.{config.namespace}"
            f".svc.cluster.local:{config.collective_port}" for i in range(n)]
        assert ("collective", config.collective_port) in \
            [(p["name"], p["containerPort"]) for p in worker["ports"]]
        assert config.collective_port in [p["port"] for p in workers_svc["spec"]["ports"]]
    elif n > 1:
        assert env["HOROVOD_SIZE"] == str(n) and env["HOROVOD_CONTROLLER"] == "gloo"
        assert env["HOROVOD_CPU_OPERATIONS"] == "gloo"
        host, port = env[RENDEZVOUS_ENV].rsplit(":", 1)
        # worker 0 of an indexed Job with this subdomain
        assert host == (f"{job_obj['metadata']['name']}-0.{pod['subdomain']}."
                        f"{config.namespace}.svc.cluster.local")
        assert int(port) in [p["containerPort"] for p in worker["ports"]]
        assert int(port) in [p["port"] for p in workers_svc["spec"]["ports"]]
    else:
        assert not any(k.startswith("HOROVOD_") for k in env)
    # the ConfigMap is mounted where PARALLAX_JOB_CONFIG points
    (mount,) = [m for m in worker["volumeMounts"] if m["name"] == "job-config"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == f"{config.name}-config"
    assert env[JOB_CONFIG_ENV] == f"{mount['mountPath']}/job.json"
    if config.cpu:
        assert worker["resources"]["requests"] == {"cpu": config.cpu, "memory": config.memory}
    # the ConfigMap's job.json reads as JSON in the YAML, not as one escaped string
    assert "  job.json: |" in text and '    "run_id": ' in text


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_manifests_pass_the_kubernetes_schemas(key, version):
    from kubernetes_validate import validate  # the test extra installs it: never skipped
    for obj in render(CONFIGS[key]):
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema offline (test_service_monitor checks it)
        validate(obj, version, strict=True)  # strict: unknown fields are errors


def test_the_oldest_release_before_the_minimum_refuses_them():
    """MIN_KUBERNETES is the true minimum: the release before it rejects the Job."""
    from kubernetes_validate import validate
    from kubernetes_validate.utils import ValidationError
    major, minor = MIN_KUBERNETES.split(".")
    job = next(o for o in render(CONFIGS["restarts-4x2-pvc"]) if o["kind"] == "Job")
    assert "podFailurePolicy" in job["spec"]
    with pytest.raises(ValidationError, match="onPodConditions"):
        validate(job, f"{major}.{int(minor) - 1}.0", strict=True)


def test_the_cluster_domain_and_the_server_wait_reach_the_workers():
    config = dataclasses.replace(CONFIGS["hybrid-4x2"], cluster_domain="corp.example",
                                 server_wait_s=900)
    job = next(o for o in render(config) if o["kind"] == "Job")
    (worker,) = [c for c in job["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "worker"]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert all(a.split(":")[0].endswith(".svc.corp.example")
               for a in env[ADDRESSES_ENV].split(",")), env[ADDRESSES_ENV]
    assert env[CONNECT_TIMEOUT_ENV] == "900"
    default = next(o for o in render(CONFIGS["hybrid-4x2"]) if o["kind"] == "Job")
    (worker,) = [c for c in default["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "worker"]
    assert {e["name"]: e.get("value") for e in worker["env"]}[CONNECT_TIMEOUT_ENV] == "600"


def test_replicas_reach_the_workers_only_when_asked():
    for key, expected in (("replicas-3x3", "2"), ("hybrid-4x2", None)):
        job = next(o for o in render(CONFIGS[key]) if o["kind"] == "Job")
        (worker,) = [c for c in job["spec"]["template"]["spec"]["containers"]
                     if c["name"] == "worker"]
        assert {e["name"]: e.get("value") for e in worker["env"]}.get(
            "PARALLAX_REPLICAS") == expected, key


@pytest.mark.parametrize("changes, words", [
    ({"workers": 0}, ["--workers 0", "at least 1"]),
    ({"replicas": 2, "servers": 1}, ["--replicas 2", "at least 2 servers"]),
    ({"replicas": 2, "sync": False}, ["--replicas 2 with --async"]),
    ({"replicas": 2, "data_dir": "/d", "data_volume_size": "1Gi"}, None),  # a copy per claim
    ({"replicas": 3}, ["--replicas 3", "give 1"]),
    ({"cluster_domain": "Cluster.Local"}, ["--cluster-domain 'Cluster.Local'", "cluster.local"]),
    ({"cluster_domain": "a..b"}, ["--cluster-domain 'a..b'"]),
    ({"server_wait_s": 0}, ["--server-wait 0", "1-86400"]),
    ({"name": "Word_LM"}, ["--name 'Word_LM'", "DNS-1123"]),
    ({"name": "-x"}, ["DNS-1123"]),
    ({"name": "a" * 41}, ["at most 40"]),
    ({"namespace": "ML"}, ["--namespace 'ML'"]),
    ({"servers": 0}, ["--servers 0", "--mode allreduce"]),
    ({"servers": -1}, ["--servers -1"]),
    ({"mode": "mirrored"}, ["--mode 'mirrored'", "hybrid"]),
    ({"server_port": 70000}, ["--server-port 70000"]),
    ({"rendezvous_port": 7000}, ["--rendezvous-port 7000 is a server port"]),
    ({"rendezvous_port": 7001}, ["--rendezvous-port 7001 is a server port", "data plane"]),
    ({"server_port": 65535}, ["--server-port 65535 leaves no port", "data"]),
    ({"cpu": "two"}, ["--cpu 'two'", "500m"]),
    ({"memory": "4 GB"}, ["--memory '4 GB'", "4Gi"]),
    ({"image": ""}, ["--image ''"]),
    ({"command": ()}, ["no command"]),
    ({"command": "python train.py"}, ["tuple of strings"]),
    ({"plan": {"shard": 4}}, ["['shard']", "shards"]),
    ({"plan": {"placement": {"x": "gpu"}}}, ["placement", "'ps' or 'allreduce'"]),
    ({"plan": {"shards": 0}}, ["shards 0", "positive"]),
    ({"plan": {"search_partitions": "yes"}}, ["search_partitions 'yes'", "true, false"]),
    ({"server_args": ("--port=1",)}, ["--server-arg '--port=1'"]),
    ({"gloo_iface": "eth 0"}, ["--gloo-iface"]),
    ({"max_restarts": -1}, ["--max-restarts -1", ">= 0"]),
    ({"max_restarts": 1, "warm_starts": "sometimes"}, ["--warm-starts 'sometimes'",
                                                       "auto, on, off"]),
    ({"max_restarts": 1, "held_backups": -2}, ["--held-backups -2", ">= 0"]),
    ({"data_volume_size": "ten"}, ["--data-volume-size 'ten'", "10Gi"]),
    ({"storage_class": "fast"}, ["--storage-class 'fast'", "--data-volume-size"]),
    ({"data_volume_size": "1Gi", "storage_class": "Fast_SSD"}, ["'Fast_SSD'"]),
    ({"data_dir": "ckpt"}, ["--data-dir 'ckpt'", "absolute"]),
    ({"servers": 0, "mode": "allreduce", "data_dir": "/d"}, ["--servers is 0"]),
    ({"server_args": ("--data-dir=/x",)}, ["--server-arg '--data-dir=/x'", "--data-dir"]),
    ({"cpu_limit": "lots"}, ["--cpu-limit 'lots'", "500m"]),
    ({"cpu": "2", "cpu_limit": "500m"}, ["--cpu 2 is more than --cpu-limit 500m",
                                         "worker pods' cpu", "cannot exceed"]),
    ({"server_memory": "8Gi", "server_memory_limit": "4Gi"},
     ["--server-memory 8Gi is more than --server-memory-limit 4Gi", "server pods' memory"]),
    ({"server_cpu": "4", "cpu_limit": "2"}, ["--server-cpu 4 is more than --cpu-limit 2"]),
    ({"memory": "1G", "memory_limit": "1Gi"}, None),  # 10^9 < 2^30: fine
    ({"gpus": 2}, ["--gpus 2", "one Horovod rank", "--gpus 1"]),
    ({"gpus": True}, ["--gpus True"]),
    ({"worker_node_selector": ("pool",)}, ["--worker-node-selector 'pool'", "no '='",
                                           "the form is KEY=VALUE"]),
    ({"server_node_selector": ("Pool_A/x=1",)}, ["--server-node-selector 'Pool_A/x=1'",
                                                 "prefix 'Pool_A'"]),
    ({"worker_node_selector": "pool=a"}, ["tuple of strings"]),
    ({"worker_tolerations": ("gpu=yes:NoSchedul",)},
     ["--worker-toleration 'gpu=yes:NoSchedul'", "effect 'NoSchedul'", "KEY=VALUE[:EFFECT]",
      "NoSchedule, PreferNoSchedule or NoExecute"]),
    ({"server_tolerations": ("=x",)}, ["--server-toleration '=x'", "not a label key"]),
    ({"worker_tolerations": ("k=bad value",)}, ["'bad value' is not a label value"]),
    ({"metrics_port": 7001}, ["--metrics-port 7001 is a server port", "data plane"]),
    ({"metrics_port": 70000}, ["--metrics-port 70000", "or 0"]),
    ({"server_port": 65534}, ["--server-port 65534 leaves no port for the servers' metrics",
                              "--metrics-port"]),
    ({"server_port": 65534, "metrics_port": 9100}, None),
    ({"service_monitor": True, "metrics_port": 0}, ["--service-monitor", "--metrics-port is 0"]),
    ({"service_monitor": True, "servers": 0, "mode": "allreduce"}, ["--servers is 0"]),
    ({"service_monitor_labels": ("release=p",)}, ["--service-monitor-label",
                                                  "give --service-monitor"]),
    ({"service_monitor": True, "service_monitor_labels": ("release",)},
     ["--service-monitor-label 'release'", "KEY=VALUE"]),
    ({"server_args": ("--metrics-port=9",)}, ["--server-arg '--metrics-port=9'",
                                              "give --metrics-port"]),
    ({"collectives": "auto"}, ["--collectives 'auto'", "horovod, tensorflow"]),
    ({"collectives": "tensorflow", "collective_port": 7001},
     ["--collective-port 7001 is already a server or rendezvous port"]),
    ({"collectives": "tensorflow", "collective_port": 0}, ["--collective-port 0", "1-65535"]),
    ({"collectives": "tensorflow", "plan": {"local_aggregation": True}},
     ["--plan local_aggregation with --collectives tensorflow", "Horovod"]),
])
def test_bad_configs_are_refused_with_the_value_and_the_fix(changes, words):
    fields = dict(name="job", image="parallax", command=("python", "t.py"), workers=2)
    fields.update(changes)
    if words is None:  # a boundary that is fine
        render(K8sConfig(**fields))
        return
    with pytest.raises(ConfigError) as err:
        render(K8sConfig(**fields))
    for word in words:
        assert word in str(err.value), str(err.value)


def _tokens_out(objects: list[dict]) -> list[dict]:
    """`objects` with each generated Secret's token replaced by its length (a new random
    token at every render)."""
    objects = json.loads(json.dumps(objects))
    for obj in objects:
        if obj["kind"] == "Secret" and "token" in obj.get("stringData", {}):
            obj["stringData"]["token"] = len(obj["stringData"]["token"])
    return objects


def test_cli_renders_yaml_to_stdout_and_files(tmp_path):
    argv = ["k8s", "--name", "lm", "--image", "parallax:dev", "--workers", "2", "--servers",
            "2", "--namespace", "team", "--cpu", "1", "--memory", "2Gi",
            "--plan", '{"shards": 2}', "--", "python", "examples/language_model.py",
            "--epochs", "1"]
    out = subprocess.run([str(BIN / "parallax"), *argv], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    objects = list(yaml.safe_load_all(out.stdout))
    assert _tokens_out(objects) == _tokens_out(render(K8sConfig(
        name="lm", image="parallax:dev", workers=2, servers=2, namespace="team", cpu="1",
        memory="2Gi", plan={"shards": 2},
        command=("python", "examples/language_model.py", "--epochs", "1"))))

    assert cli.main([*argv[:-5], "-o", str(tmp_path / "m"), *argv[-5:]]) == 0
    files = sorted((tmp_path / "m").glob("*.yaml"))
    assert _tokens_out([yaml.safe_load(f.read_text()) for f in files]) == _tokens_out(objects)
    (secret_file,) = [f for f in files if "-secret-" in f.name]
    assert secret_file.stat().st_mode & 0o777 == 0o600  # the token: its owner's alone

    bad = subprocess.run([str(BIN / "parallax"), "k8s", "--name", "LM", "--image", "x", "--",
                          "python", "t.py"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "DNS-1123" in bad.stderr and not bad.stdout
    bad = subprocess.run([str(BIN / "parallax"), "k8s", "--name", "lm", "--image", "x",
                          "--plan", "{shards: 2}", "--", "python", "t.py"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--plan" in bad.stderr and "is not JSON" in bad.stderr


def test_strategy_options_come_from_the_mounted_job_config(tmp_path, monkeypatch):
    config = CONFIGS["hybrid-4x2"]
    (cm,) = [o for o in render(config) if o["kind"] == "ConfigMap"]
    path = tmp_path / "job.json"
    path.write_text(cm["data"]["job.json"])
    monkeypatch.setenv(JOB_CONFIG_ENV, str(path))
    assert strategy_options() == {"shards": 4, "placement": {"dense/kernel": "ps"}}
    path.write_text("[1]")
    with pytest.raises(ConfigError, match="PARALLAX_JOB_CONFIG=.* is not the JSON object"):
        strategy_options()
    monkeypatch.delenv(JOB_CONFIG_ENV)
    assert strategy_options() == {}


def test_strategy_applies_the_job_plan_by_itself_and_given_arguments_win(
        tmp_path, monkeypatch, caplog):
    """A real one-worker ParallaxStrategy with its embedded servers, in a worker pod's
    environment: job.json's plan overrides apply without strategy_options(); an argument
    given to the constructor wins over the job's."""
    import keras
    import numpy as np

    import parallax
    config = K8sConfig(name="auto", image="x", command=("t",), plan={
        "shards": 2, "placement": {"dense/kernel": "ps"}, "search_partitions": True})
    (cm,) = [o for o in render(config) if o["kind"] == "ConfigMap"]
    path = tmp_path / "job.json"
    path.write_text(cm["data"]["job.json"])
    for name in ("PARALLAX_PS_ADDRESSES", "PARALLAX_RUN_ID", "PARALLAX_MODE", "PARALLAX_SYNC"):
        monkeypatch.delenv(name, raising=False)  # embedded servers, not the job's
    monkeypatch.setenv(JOB_CONFIG_ENV, str(path))
    with caplog.at_level("INFO", logger="parallax"):
        strategy = parallax.ParallaxStrategy(search_partitions=False, log_plan=False)
    (line,) = [r.getMessage() for r in caplog.records if "plan overrides" in r.getMessage()]
    assert line == (f"plan overrides from {JOB_CONFIG_ENV}={path}: "
                    f"placement={{'dense/kernel': 'ps'}}, shards=2 (ParallaxStrategy's own "
                    f"search_partitions kept)")
    assert strategy.extended._search_setting is False
    keras.utils.set_random_seed(1)
    ids = np.arange(64).reshape(16, 4) % 50
    with strategy.scope():
        inputs = keras.Input((4,), dtype="int64")
        hidden = keras.layers.Embedding(50, 4, name="embedding")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, name="dense")(
            keras.layers.Flatten()(hidden)))
        model.compile(keras.optimizers.SGD(0.1), loss="mse")
    model.fit(ids, np.ones((16, 1), "float32"), batch_size=8, epochs=1, verbose=0)
    assert strategy.plan.get("embedding/embeddings").shards == 2  # from the job
    assert strategy.plan.get("dense/kernel").placement == "ps"     # from the job
    caplog.clear()
    with caplog.at_level("INFO", logger="parallax"):
        given = parallax.ParallaxStrategy(shards=1, placement={}, local_aggregation=False,
                                          search_partitions=False, log_plan=False)
    assert (given.extended.config.shards, dict(given.extended.config.placement)) == (1, {})
    assert "none applied (ParallaxStrategy's own placement, search_partitions, shards kept)" \
        in caplog.text


def test_job_json_reads_as_a_yaml_block_of_pretty_json(tmp_path):
    objects = render(CONFIGS["hybrid-4x2"])
    text = k8s.dump(objects)
    block = text[text.index("  job.json: |"):].split("\n---")[0].splitlines()
    assert block[1] == "    {" and '      "mode": "hybrid",' in block  # indented JSON
    assert "\\n" not in text and '\\"' not in text  # no escaped string anywhere
    assert list(yaml.safe_load_all(text)) == objects
    assert "image: registry.example.com/parallax:0.1" in text  # one-line strings stay plain
    (config_file, *_) = sorted(p for p in k8s.write(objects, str(tmp_path)))
    assert "  job.json: |" in config_file.read_text()
    assert yaml.safe_load(config_file.read_text()) == objects[0]


def _parsers():
    from parallax.runtime import logs
    parsers = [k8s._parser(), k8s._watch_parser()]
    for parser in parsers:
        logs.add_argument(parser)  # as `parallax k8s` adds it
    return parsers


def test_every_k8s_option_has_help():
    for parser in _parsers():
        for action in parser._actions:
            assert action.help and action.help != argparse.SUPPRESS, action.option_strings


# --------------------------------------------------------------------------- resources, scheduling

def _server_pod(objs, config) -> dict:
    return objs["StatefulSet", f"{config.name}-ps"]["spec"]["template"]["spec"]


def _worker_pod(objs, config) -> dict:
    return objs["Job", f"{config.name}-worker"]["spec"]["template"]["spec"]


def test_requests_and_limits_per_role_and_one_gpu_per_worker():
    config = CONFIGS["gpu-scheduled"]
    objs = _by_kind(render(config))
    sts, job = objs["StatefulSet", "gpu-ps"], objs["Job", "gpu-worker"]
    assert _container(job, "worker")["resources"] == {
        "requests": {"cpu": "1", "memory": "2Gi"},
        "limits": {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "1"}}
    assert _container(sts, "server")["resources"] == {  # --server-* win over every pod's
        "requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"cpu": "8", "memory": "16Gi"}}
    assert _container(sts, "job-watch")["resources"] == k8s.WATCHER  # small, fixed
    # only limits: Kubernetes makes the requests equal
    limited = _by_kind(render(K8sConfig(name="l", image="x", command=("t",),
                                        memory_limit="1Gi", server_cpu_limit="3")))
    assert _container(limited["Job", "l-worker"], "worker")["resources"] == {
        "limits": {"memory": "1Gi"}}
    assert _container(limited["StatefulSet", "l-ps"], "server")["resources"] == {
        "limits": {"cpu": "3", "memory": "1Gi"}}
    plain = _by_kind(render(CONFIGS["ps-1x3-async"]))
    assert "resources" not in _container(plain["Job", "ctr-7-worker"], "worker")
    assert "resources" not in _container(plain["StatefulSet", "ctr-7-ps"], "server")


def test_node_selectors_and_tolerations_per_role():
    config = CONFIGS["gpu-scheduled"]
    objs = _by_kind(render(config))
    worker, server = _worker_pod(objs, config), _server_pod(objs, config)
    assert worker["nodeSelector"] == {"cloud.google.com/gke-nodepool": "gpu-pool"}
    assert worker["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Equal", "value": "present",
         "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Exists"}]
    assert server["nodeSelector"] == {"pool": "highmem", "zone": ""}
    assert server["tolerations"] == [{"key": "highmem", "operator": "Exists",
                                      "effect": "NoExecute"}]
    plain = _by_kind(render(CONFIGS["hybrid-4x2"]))
    for pod in (_worker_pod(plain, CONFIGS["hybrid-4x2"]),
                _server_pod(plain, CONFIGS["hybrid-4x2"])):
        assert "nodeSelector" not in pod and "tolerations" not in pod


def test_cli_resource_and_scheduling_flags_reach_the_config(capsys):
    config, _ = k8s.config_from_args([
        "--name", "r", "--image", "x", "--cpu", "1", "--cpu-limit", "2", "--memory", "1Gi",
        "--memory-limit", "2Gi", "--server-cpu", "3", "--server-cpu-limit", "4",
        "--server-memory", "5Gi", "--server-memory-limit", "6Gi", "--gpus", "1",
        "--worker-node-selector", "a=b", "--worker-node-selector", "c=d",
        "--server-node-selector", "e=f", "--worker-toleration", "g=h:NoSchedule",
        "--server-toleration", "i", "--", "python", "t.py"])
    assert (config.cpu, config.cpu_limit, config.memory, config.memory_limit) == \
        ("1", "2", "1Gi", "2Gi")
    assert (config.server_cpu, config.server_cpu_limit, config.server_memory,
            config.server_memory_limit, config.gpus) == ("3", "4", "5Gi", "6Gi", 1)
    assert config.worker_node_selector == ("a=b", "c=d")
    assert (config.server_node_selector, config.worker_tolerations,
            config.server_tolerations) == (("e=f",), ("g=h:NoSchedule",), ("i",))
    code = cli.main(["k8s", "--name", "r", "--image", "x", "--worker-toleration",
                     "gpu=yes:Sometimes", "--", "t"])
    err = capsys.readouterr().err
    assert code == 2 and "--worker-toleration 'gpu=yes:Sometimes'" in err
    assert "the form is KEY=VALUE[:EFFECT]" in err


# --------------------------------------------------------------------------- metrics

def test_servers_expose_their_metrics_port_to_the_service_and_prometheus():
    from parallax_ps.server import parse_args as server_args
    config = CONFIGS["hybrid-4x2"]
    objs = _by_kind(render(config))
    sts = objs["StatefulSet", "wordlm-ps"]
    server = _container(sts, "server")
    # the server's own parser takes the rendered command: metrics on every interface
    parsed = server_args(server["command"][2:])
    assert (parsed.metrics_port, parsed.metrics_host) == (7002, "0.0.0.0")
    assert (parsed.port, parsed.data_port) == (7000, 7001)
    assert {"name": "metrics", "containerPort": 7002} in server["ports"]
    assert {"name": "metrics", "port": 7002, "targetPort": 7002} in \
        objs["Service", "wordlm-ps"]["spec"]["ports"]
    # a secure job's scrapes need the token: no annotation for Prometheus' pod discovery,
    # which sends none (--insecure keeps them)
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert "prometheus.io/scrape" not in annotations
    opened = _by_kind(render(dataclasses.replace(config, insecure=True)))
    annotations = opened["StatefulSet", "wordlm-ps"]["spec"]["template"]["metadata"][
        "annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "7002"
    assert not any(kind == "ServiceMonitor" for kind, _ in objs)  # only when asked
    moved = _container(_by_kind(render(K8sConfig(name="m", image="x", command=("t",),
                                                 server_port=8000, metrics_port=9100)))[
        "StatefulSet", "m-ps"], "server")
    assert server_args(moved["command"][2:]).metrics_port == 9100
    off = _by_kind(render(CONFIGS["keep-servers"]))
    server = _container(off["StatefulSet", "kept-ps"], "server")
    assert server_args(server["command"][2:]).metrics_port is None
    assert [p["name"] for p in server["ports"]] == ["grpc", "data"]
    assert [p["name"] for p in off["Service", "kept-ps"]["spec"]["ports"]] == ["grpc"]
    assert "prometheus.io/port" not in off["StatefulSet", "kept-ps"]["spec"]["template"][
        "metadata"]["annotations"]


def test_service_monitor_scrapes_the_servers_metrics_port():
    config = CONFIGS["monitored-pvc"]
    objects = render(config)
    objs = _by_kind(objects)
    monitor = objs["ServiceMonitor", "mon-ps"]
    kinds = [o["kind"] for o in objects]
    assert kinds.index("ServiceMonitor") > kinds.index("StatefulSet")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"  # what Prometheus selects
    assert monitor["metadata"]["labels"][k8s.LABEL_JOB] == "mon"
    spec = monitor["spec"]
    assert set(spec) == {"selector", "namespaceSelector", "endpoints"}
    assert spec["namespaceSelector"] == {"matchNames": [config.namespace]}
    services = [o for o in objects if o["kind"] == "Service"
                and all(o["metadata"]["labels"].get(k) == v
                        for k, v in spec["selector"]["matchLabels"].items())]
    assert [s["metadata"]["name"] for s in services] == ["mon-ps"]  # not the workers'
    (endpoint,) = spec["endpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "30s",
                        "authorization": {"type": "Bearer", "credentials": {
                            "name": "mon-token", "key": "token"}}}  # the job's token
    assert endpoint["port"] in [p["name"] for p in services[0]["spec"]["ports"]]


# --------------------------------------------------------------------------- servers' lifetime

def test_servers_end_with_the_job_through_a_watcher_with_minimal_rights():
    config = CONFIGS["hybrid-4x2"]
    objects = render(config)
    objs = _by_kind(objects)
    account, role, binding = (objs[kind, "wordlm-ps"]
                              for kind in ("ServiceAccount", "Role", "RoleBinding"))
    kinds = [o["kind"] for o in objects]
    assert kinds.index("RoleBinding") < kinds.index("StatefulSet")  # rights before the pods
    # get the worker Job, delete the servers' StatefulSet, by name; nothing else
    assert role["rules"] == [
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get"],
         "resourceNames": ["wordlm-worker"]},
        {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["delete"],
         "resourceNames": ["wordlm-ps"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "wordlm-ps"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "wordlm-ps",
                                    "namespace": "ml"}]
    sts, job = objs["StatefulSet", "wordlm-ps"], objs["Job", "wordlm-worker"]
    pod = sts["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert account["automountServiceAccountToken"] is False
    assert pod["automountServiceAccountToken"] is False  # the server gets no credentials
    assert sts["spec"]["template"]["metadata"]["annotations"][
        "kubectl.kubernetes.io/default-container"] == "server"
    watcher = _container(sts, "job-watch")
    assert watcher["command"][:3] == ["parallax", "k8s", "watch-job"]
    args = k8s._watch_parser().parse_args(watcher["command"][3:])
    assert (args.namespace, args.job, args.servers) == (
        "ml", job["metadata"]["name"], sts["metadata"]["name"])
    assert watcher["volumeMounts"] == [{"name": "api-token", "readOnly": True,
                                        "mountPath": k8s.SERVICE_ACCOUNT_DIR}]
    assert "api-token" not in str(_container(sts, "server"))
    (token,) = [v for v in pod["volumes"] if v["name"] == "api-token"]
    sources = token["projected"]["sources"]
    assert sources[0]["serviceAccountToken"]["path"] == "token"
    assert sources[1]["configMap"] == {"name": "kube-root-ca.crt",
                                       "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert not any("job-watch" in str(o) for o in objects if o["kind"] == "Job")


def test_keep_servers_renders_no_watcher_and_no_rights():
    objs = _by_kind(render(CONFIGS["keep-servers"]))
    assert not {kind for kind, _ in objs} & {"ServiceAccount", "Role", "RoleBinding"}
    pod = objs["StatefulSet", "kept-ps"]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["server"]
    assert "serviceAccountName" not in pod
    assert [v["name"] for v in pod["volumes"]] == ["parallax-token"]  # no API token


def test_cli_server_flags_reach_the_config():
    config, _ = k8s.config_from_args([
        "--name", "r", "--image", "x", "--keep-servers", "--metrics-port", "9100",
        "--service-monitor", "--service-monitor-label", "release=p", "--metrics-namespace",
        "monitoring", "--", "python", "t.py"])
    assert (config.keep_servers, config.metrics_port, config.service_monitor,
            config.service_monitor_labels) == (True, 9100, True, ("release=p",))
    default, _ = k8s.config_from_args(["--name", "r", "--image", "x", "--", "t"])
    assert (default.keep_servers, default.metrics_port, default.service_monitor) == (
        False, None, False)


class FakeAPIServer:
    """The two endpoints of a Kubernetes API server the watcher uses, over TLS, refusing
    requests without the service account's token (401), as the real one does."""

    JOB = "/apis/batch/v1/namespaces/ml/jobs/wordlm-worker"
    SERVERS = "/apis/apps/v1/namespaces/ml/statefulsets/wordlm-ps"

    def __init__(self, creds, token: str):
        import http.server
        import ssl
        import threading
        self.job: dict | None = None   # GET answers it, or 404 when None
        self.status: int | None = None  # answer every request with this status instead
        self.requests: list[tuple[str, str, dict | None]] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                fake.requests.append((self.command, self.path, body))
                if self.headers.get("Authorization") != f"Bearer {token}":
                    return self._answer(401, {"kind": "Status", "code": 401})
                if fake.status is not None:
                    return self._answer(fake.status, {"kind": "Status"})
                if self.command == "GET" and self.path == fake.JOB and fake.job:
                    return self._answer(200, fake.job)
                if self.command == "DELETE" and self.path == fake.SERVERS:
                    return self._answer(200, {"kind": "StatefulSet"})
                return self._answer(404, {"kind": "Status", "code": 404})

            do_GET = do_DELETE = _handle

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(creds.server_cert, creds.server_key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def set_job(self, uid: str, condition: str | None = None) -> None:
        conditions = [{"type": "FailureTarget", "status": "True"}]  # not the end yet
        if condition:
            conditions.append({"type": condition, "status": "True"})
        self.job = {"kind": "Job", "metadata": {"name": "wordlm-worker", "uid": uid},
                    "status": {"conditions": conditions}}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def api_creds(tmp_path_factory):
    from parallax.protocol.security import generate_job_credentials
    return generate_job_credentials(tmp_path_factory.mktemp("api"))


@pytest.fixture
def api(api_creds):
    from parallax.protocol.security import read_token
    server = FakeAPIServer(api_creds, read_token(api_creds.token_file))
    yield server
    server.close()


def _watch(api, creds) -> k8s.JobWatch:
    client = k8s.KubeAPI(api.url, str(creds.token_file), str(creds.ca_cert))
    return k8s.JobWatch(client, "ml", "wordlm-worker", "wordlm-ps")


@pytest.mark.parametrize("condition", ["Complete", "Failed"])
def test_job_watch_deletes_the_servers_once_the_job_has_finished(api, api_creds, condition):
    watch = _watch(api, api_creds)
    assert watch.check() is None  # the Job is not created yet: the servers wait for it
    api.set_job("u1")
    assert watch.check() is None and watch.uid == "u1"  # running
    api.set_job("u1", condition)
    assert watch.check() == f"Job wordlm-worker finished ({condition})"
    assert watch.end_servers()
    assert api.requests[-1] == ("DELETE", api.SERVERS, {
        "apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"})
    assert [r[:2] for r in api.requests[:-1]] == [("GET", api.JOB)] * 3


def test_job_watch_ends_the_servers_when_the_job_is_deleted_and_follows_a_new_one(
        api, api_creds, caplog):
    watch = _watch(api, api_creds)
    api.set_job("u1")
    assert watch.check() is None
    api.set_job("u2")  # deleted and created again between two reads: the servers serve it
    with caplog.at_level("INFO", logger="parallax"):
        assert watch.check() is None and watch.uid == "u2"
    assert "watching Job wordlm-worker (uid u2)" in caplog.text
    api.job = None
    assert watch.check() == "Job wordlm-worker was deleted"
    api.requests.clear()
    api.status = 404  # the StatefulSet is gone already (deleted by hand, another watcher)
    assert watch.end_servers()


def test_job_watch_says_once_what_is_missing_and_keeps_watching(api, api_creds, caplog,
                                                                  tmp_path):
    watch = _watch(api, api_creds)
    api.status = 403
    with caplog.at_level("WARNING", logger="parallax"):
        assert watch.check() is None and watch.check() is None
        assert not watch.end_servers()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings  # one per problem, not one per poll
    assert "cannot read Job wordlm-worker: the API server answered HTTP 403" in warnings[0]
    assert "apply the Role and RoleBinding wordlm-ps" in warnings[0]
    assert "cannot delete StatefulSet wordlm-ps" in warnings[1]
    # no token: 401, with the same fix
    other = tmp_path / "token"
    other.write_text("not-the-token\n")
    caplog.clear()
    api.status = None
    stranger = k8s.JobWatch(k8s.KubeAPI(api.url, str(other), str(api_creds.ca_cert)), "ml",
                            "wordlm-worker", "wordlm-ps")
    assert stranger.check() is None and "HTTP 401" in caplog.text
    # an API server not reachable, or not the one the CA vouches for
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"https://127.0.0.1:{s.getsockname()[1]}"
    from parallax.protocol.security import generate_job_credentials
    strange_ca = generate_job_credentials(tmp_path / "other").ca_cert
    for url, ca in ((closed, api_creds.ca_cert), (api.url, strange_ca)):
        caplog.clear()
        lost = k8s.JobWatch(k8s.KubeAPI(url, str(api_creds.token_file), str(ca)), "ml",
                            "wordlm-worker", "wordlm-ps")
        assert lost.check() is None and not lost.end_servers()
        assert "cannot reach the API server at" in caplog.text
    assert "CERTIFICATE_VERIFY_FAILED" in caplog.text


def test_watch_job_polls_until_the_job_ends_then_deletes_the_servers(api, api_creds):
    import threading
    api.set_job("u1")
    stop = threading.Event()
    done: list[bool] = []
    thread = threading.Thread(target=lambda: done.append(
        k8s.watch_job(_watch(api, api_creds), stop, poll_s=0.05)))
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive() and not any(r[0] == "DELETE" for r in api.requests)
    api.set_job("u1", "Complete")
    thread.join(timeout=10)
    assert done == [True]
    assert [r[0] for r in api.requests].count("DELETE") == 1
    stop.set()  # a pod being stopped before the Job ends: nothing is deleted
    api.requests.clear()
    api.set_job("u1")
    assert k8s.watch_job(_watch(api, api_creds), stop, poll_s=0.05) is False
    assert not any(r[0] == "DELETE" for r in api.requests)


def test_watch_job_command_says_it_runs_in_a_cluster():
    env = {"PATH": f"{BIN}:/usr/bin:/bin"}
    out = subprocess.run([str(BIN / "parallax"), "k8s", "watch-job", "--namespace", "ml",
                          "--job", "j-worker", "--servers", "j-ps"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "KUBERNETES_SERVICE_HOST is not set" in out.stderr
    out = subprocess.run([str(BIN / "parallax"), "k8s", "watch-job", "--help"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--poll-seconds" in out.stdout


# --------------------------------------------------------------------------- worker bootstrap

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_horovod_env_matches_what_horovodrun_gives_one_slot_hosts():
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments
    from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
    plan = get_host_assignments([HostInfo(f"worker-{r}", 1) for r in range(3)], 3)
    for slot in plan:
        env = k8s.horovod_env(slot.rank, 3, "10.0.0.1", 7070, "eth0")
        expected = {**create_slot_env_vars(slot),
                    **create_run_env_vars("10.0.0.1", ["eth0"], 7070)}
        expected.pop("NCCL_SOCKET_IFNAME")  # gloo only: no NCCL in the image
        assert env == {k: str(v) for k, v in expected.items()}


@pytest.mark.multiprocess
def test_worker_bootstrap_runs_a_two_rank_gloo_job_without_horovodrun(tmp_path):
    """Two 'pods' on loopback: index 0 serves the rendezvous, index 1 starts first and waits
    for it; each runs `parallax k8s worker -- python hvd_allreduce.py` with the env the Job
    manifest gives (gloo iface lo instead of eth0)."""
    config = K8sConfig(name="t", image="x", workers=2, servers=0, mode="allreduce",
                       command=(sys.executable,
                                str(ROOT / "tests" / "helpers" / "hvd_allreduce.py")))
    (job,) = [o for o in render(config) if o["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    port = _free_port()
    env = {**_env(container), RENDEZVOUS_ENV: f"localhost:{port}",
           "HOROVOD_GLOO_IFACE": "lo", "PATH": f"{BIN}:/usr/bin:/bin",
           "HOROVOD_GLOO_TIMEOUT_SECONDS": "60"}
    argv = [str(BIN / "parallax"), *container["command"][1:]]
    procs = {}
    for index in (1, 0):  # rank 1 first: it must wait for rank 0's rendezvous
        procs[index] = subprocess.Popen(argv, env={**env, "JOB_COMPLETION_INDEX": str(index)},
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        if index == 1:
            try:
                procs[1].wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            assert procs[1].poll() is None, "rank 1 did not wait for the rendezvous"
    try:
        outs = {i: p.communicate(timeout=180)[0] for i, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for index, out in outs.items():
        assert procs[index].returncode == 0, out[-3000:]
        assert f"HVD rank={index} size=2 sum=[1.0, 2.0]" in out, out[-3000:]


TF_SUM = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
from parallax.tf.collectives import make_collectives
rank = int(os.environ["PARALLAX_WORKER_RANK"])
workers = make_collectives("tensorflow")
[total] = workers.allreduce_sum([tf.constant([rank + 1.0])])
print(f"TF rank={rank} size={workers.size} sum={float(total[0])} "
      f"horovod={any(k.startswith('HOROVOD_') for k in os.environ)}", flush=True)
"""


@pytest.mark.multiprocess
def test_worker_bootstrap_runs_tensorflows_collectives_without_horovod(tmp_path):
    """--collectives tensorflow: two 'pods' on loopback get their rank from
    JOB_COMPLETION_INDEX and sum over TensorFlow's collectives (the manifests' worker
    addresses replaced by loopback ports, as DNS names would resolve in a cluster)."""
    script = tmp_path / "tf_sum.py"
    script.write_text(TF_SUM)
    config = K8sConfig(name="t", image="x", workers=2, servers=0, mode="allreduce",
                       collectives="tensorflow", command=(sys.executable, str(script)))
    (job,) = [o for o in render(config) if o["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    results = _two_pods(container, {
        "PARALLAX_WORKERS": ",".join(f"127.0.0.1:{_free_port()}" for _ in range(2)),
        **_without_horovod(tmp_path)}, 180)
    for index, (code, out) in results.items():
        assert code == 0, out[-3000:]
        assert f"TF rank={index} size=2 sum=3.0 horovod=False" in out, out[-3000:]


def _two_pods(container: dict, extra_env: dict, timeout: float) -> dict[int, tuple[int, str]]:
    """Run the worker container's command as pods 1 and 0 on loopback (the manifests'
    environment, then `extra_env`); {index: (exit code, output)}."""
    env = {**_env(container), "PATH": f"{BIN}:/usr/bin:/bin", **_python_path(), **extra_env}
    argv = [str(BIN / "parallax"), *container["command"][1:]]
    procs = {i: subprocess.Popen(argv, env={**env, "JOB_COMPLETION_INDEX": str(i)},
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in (1, 0)}
    try:
        outs = {i: p.communicate(timeout=timeout)[0] for i, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return {i: (procs[i].returncode, outs[i]) for i in procs}


def test_worker_bootstrap_with_one_worker_runs_the_command_alone(tmp_path):
    config = K8sConfig(name="t", image="x", workers=1, servers=1,
                       command=(sys.executable, "-c",
                                "import os; print(sorted(k for k in os.environ "
                                "if k.startswith(('HOROVOD_', 'PARALLAX_'))))"))
    (job,) = [o for o in render(config) if o["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    out = subprocess.run([str(BIN / "parallax"), *container["command"][1:]],
                         env={**_env(container), "JOB_COMPLETION_INDEX": "0",
                              "PATH": f"{BIN}:/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HOROVOD" not in out.stdout and "PARALLAX_PS_ADDRESSES" in out.stdout


def test_worker_bootstrap_reports_a_missing_rendezvous():
    env = {"HOROVOD_SIZE": "2", "JOB_COMPLETION_INDEX": "1",
           RENDEZVOUS_ENV: f"127.0.0.1:{_free_port()}", RENDEZVOUS_TIMEOUT_ENV: "1",
           "PATH": f"{BIN}:/usr/bin:/bin"}
    out = subprocess.run([str(BIN / "parallax"), "k8s", "worker", "--", "true"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "rendezvous" in out.stderr and "worker 0" in out.stderr, out.stderr


# --------------------------------------------------------------------------- restarts (--max-restarts)

def _objects(config: K8sConfig):
    objs = _by_kind(render(config))
    job = objs["Job", f"{config.name}-worker"]
    sts = objs.get(("StatefulSet", f"{config.name}-ps"))
    (worker,) = job["spec"]["template"]["spec"]["containers"]
    return objs, job, sts, worker


@pytest.mark.parametrize("key", RESTART_CONFIGS)
def test_restarts_restart_the_gang_in_place_and_recreate_only_lost_pods(key):
    config = CONFIGS[key]
    objs, job, _, worker = _objects(config)
    spec, env = job["spec"], _env(worker)
    # the gang supervisor in every pod: worker 0 coordinates, even with one worker
    assert worker["command"] == ["parallax", "k8s", "worker", "--", *config.command]
    assert env[MAX_RESTARTS_ENV] == str(config.max_restarts)
    assert env[RENDEZVOUS_ENV].startswith(f"{config.name}-worker-0.{config.name}-workers.")
    assert [p["containerPort"] for p in worker["ports"]][0] == config.rendezvous_port
    assert "PARALLAX_RESTART_COUNT" not in env  # each attempt gets its own from the gang
    # the run id is pinned: every attempt and every recreated pod resumes the same run
    run_id = json.loads(objs["ConfigMap", f"{config.name}-config"]["data"]["job.json"])
    assert env["PARALLAX_RUN_ID"] == run_id["run_id"] == config.name
    # pod-level: Never (podFailurePolicy needs it), N whole gangs of recreated pods, and
    # only disrupted pods or pods that lost worker 0 are recreated; others fail the Job
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["backoffLimit"] == config.max_restarts * config.workers
    disrupted, others = spec["podFailurePolicy"]["rules"]
    assert disrupted == {"action": "Count",
                         "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert others["action"] == "FailJob"
    assert others["onExitCodes"] == {"containerName": "worker", "operator": "NotIn",
                                     "values": [k8s.gang.LOST_GANG_EXIT]}


@pytest.mark.parametrize("key", RESTART_CONFIGS)
def test_restarts_keep_the_servers_data_dir_on_a_volume(key):
    config = CONFIGS[key]
    _, _, sts, _ = _objects(config)
    pod = sts["spec"]["template"]["spec"]
    server = _container(sts, "server")
    assert pod["restartPolicy"] == "Always"
    args = server["command"]
    data_dir = args[args.index("--data-dir") + 1]
    assert data_dir == (config.data_dir or k8s.DEFAULT_DATA_DIR) == k8s.server_data_dir(config)
    (mount,) = [m for m in server["volumeMounts"] if m["name"] == "data"]
    assert mount["mountPath"] == data_dir
    assert pod["securityContext"]["fsGroup"] == 10001  # the image's user can write it
    volumes = [v for v in pod.get("volumes", []) if v["name"] == mount["name"]]
    if config.data_volume_size:
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == mount["name"] and not volumes
        assert claim["spec"]["resources"]["requests"]["storage"] == config.data_volume_size
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert claim["spec"]["storageClassName"] == config.storage_class
        assert claim["metadata"]["labels"][k8s.LABEL_JOB] == config.name
        # the claims outlive the StatefulSet, which the job's end deletes
        assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {
            "whenDeleted": "Retain", "whenScaled": "Retain"}
    else:
        assert volumes == [{"name": mount["name"], "emptyDir": {}}]
        assert "volumeClaimTemplates" not in sts["spec"]


@pytest.mark.parametrize("key", sorted(set(CONFIGS) - set(RESTART_CONFIGS)))
def test_without_restart_flags_the_manifests_are_as_before(key):
    config = CONFIGS[key]
    _, job, sts, worker = _objects(config)
    assert job["spec"]["backoffLimit"] == 0 and "podFailurePolicy" not in job["spec"]
    assert MAX_RESTARTS_ENV not in _env(worker)
    assert (RENDEZVOUS_ENV in _env(worker)) == (config.workers > 1
                                                and config.collectives == "horovod")
    if sts and not config.data_volume_size:
        pod = sts["spec"]["template"]["spec"]
        assert "--data-dir" not in _container(sts, "server")["command"]
        assert "data" not in [m["name"] for m in _container(sts, "server")["volumeMounts"]]
        assert "volumeClaimTemplates" not in sts["spec"]
        assert all(v["name"] != "data" for v in pod.get("volumes", []))


def test_data_dir_alone_gets_a_pod_volume_at_that_path():
    config = K8sConfig(name="d", image="x", command=("t",), data_dir="/srv/ps")
    _, job, sts, _ = _objects(config)
    pod = sts["spec"]["template"]["spec"]
    assert _container(sts, "server")["volumeMounts"][0] == {"name": "data",
                                                             "mountPath": "/srv/ps"}
    assert pod["volumes"][0] == {"name": "data", "emptyDir": {}}
    assert job["spec"]["backoffLimit"] == 0


def test_cli_restart_flags_reach_the_manifests_and_have_help(capsys):
    config, _ = k8s.config_from_args([
        "--name", "r", "--image", "x", "--workers", "2", "--max-restarts", "4", "--data-dir",
        "/ckpt", "--data-volume-size", "5Gi", "--storage-class", "gp3", "--", "python", "t.py"])
    assert (config.max_restarts, config.data_dir, config.data_volume_size,
            config.storage_class) == (4, "/ckpt", "5Gi", "gp3")
    with pytest.raises(SystemExit):
        k8s.config_from_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-restarts N", "--data-dir DIR", "--data-volume-size Q",
                 "--storage-class NAME"):
        assert flag in text
    assert "PARALLAX_RESTART_COUNT" in text and "PersistentVolumeClaim" in text


# The gang's state machine, with a fake clock.

class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _gang(size: int, max_restarts: int, started: list, clock=None):
    from parallax.launch.restarts import RestartBudget
    said = []
    g = k8s.gang.Gang(size, RestartBudget(max_restarts, 0, said.append), started.append,
                      timeout=5, clock=clock or _Clock(), say=said.append)
    return g, said


def test_gang_restarts_every_rank_together_after_one_fails():
    started = []
    g, said = _gang(2, 1, started)
    g.poll(0)
    g.step()
    assert g.state == "starting" and started == []  # rank 1 has not checked in
    g.poll(1)
    g.step()
    assert (g.state, g.attempt, started) == ("running", 0, [0])
    g.report(1, 0, 3)
    g.step()
    assert g.poll(0) == {"attempt": 0, "state": "aborting", "code": 3}
    g.step()
    assert g.state == "aborting"  # rank 0's command still runs: wait for it to stop
    g.report(0, 0, -15)
    g.step()
    assert (g.state, g.attempt) == ("starting", 1)
    assert "worker 1's command exited with 3" in said[0] and "restart 1 of 1" in said[0]
    assert g.code == 0
    g.report(0, 0, 0)  # a late report of the old attempt changes nothing
    g.step()
    assert (g.state, g.attempt, started) == ("running", 1, [0, 1])
    g.report(0, 1, 0)
    g.step()
    assert g.state == "running"
    g.report(1, 1, 0)
    g.step()
    assert g.poll(0)["state"] == "done" and not g.everyone_told()
    g.poll(1)
    assert g.everyone_told()


def test_gang_fails_with_the_code_once_the_restarts_are_used():
    started = []
    g, said = _gang(1, 0, started)
    g.poll(0)
    g.step()
    g.report(0, 0, 7)
    g.step()
    g.step()
    assert g.poll(0) == {"attempt": 0, "state": "failed", "code": 7}


def test_gang_aborts_when_a_rank_stops_answering():
    clock, started = _Clock(), []
    g, said = _gang(2, 2, started, clock)
    g.poll(0), g.poll(1)
    g.step()
    clock.now = 4
    g.poll(0)
    clock.now = 6  # rank 1 silent for 6 s > timeout 5
    g.step()
    assert g.state == "aborting" and "worker 1 stopped answering" in g.cause
    g.report(0, 0, -15)
    g.step()
    assert (g.state, g.attempt) == ("starting", 1)
    g.poll(0)
    g.step()
    assert g.state == "starting"  # waits for the recreated pod of rank 1
    g.poll(1)
    g.step()
    assert (g.state, started) == ("running", [0, 1])


def test_gang_fails_when_the_servers_cannot_be_prepared():
    def broken(attempt):
        raise RuntimeError("servers unreachable")
    g, said = _gang(1, 3, [])
    g.on_start = broken
    g.poll(0)
    g.step()
    assert (g.state, g.code) == ("failed", 1) and "servers unreachable" in said[0]


# The bootstrap for real: two 'pods' on loopback.

RESTART_PROBE = """
import os, sys, time
rank = os.environ.get("HOROVOD_RANK", os.environ.get("PARALLAX_WORKER_RANK"))
attempt = os.environ["PARALLAX_RESTART_COUNT"]
start = "warm" if "tensorflow" in sys.modules else "cold"  # (forked from the pod's warm process)
print(f"rank={rank} attempt={attempt} run={os.environ['PARALLAX_RUN_ID']} start={start}",
      flush=True)
if attempt == "0":
    if rank == "1":
        sys.exit(3)
    time.sleep(120)  # must be stopped by the gang, not waited for
sys.exit(int(os.environ.get("FINAL_CODE", "0")) if attempt == os.environ["LAST"] else 0)
"""


def _gang_pods(tmp_path, max_restarts: int, extra_env: dict,
               collectives: str = "horovod", warm_starts: str = "auto") -> dict:
    script = tmp_path / "probe.py"
    script.write_text(RESTART_PROBE)
    config = K8sConfig(name="g", image="x", workers=2, servers=0, mode="allreduce",
                       max_restarts=max_restarts, command=(sys.executable, str(script)),
                       collectives=collectives, warm_starts=warm_starts)
    (job,) = [o for o in render(config) if o["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    image = _without_horovod(tmp_path) if collectives == "tensorflow" else {}
    return _two_pods(container, {RENDEZVOUS_ENV: f"localhost:{_free_port()}",
                                 GANG_TIMEOUT_ENV: "20", **image, **_mounted_token(tmp_path),
                                 **extra_env}, 90)


def test_held_backups_reach_the_worker_pods_and_keep_the_tables_across_restarts(capsys):
    import dataclasses
    from parallax.launch.k8s_bootstrap import _fresh_start
    config = CONFIGS[RESTART_CONFIGS[0]]
    assert HELD_BACKUPS_ENV not in _env(_objects(config)[3])
    env = _env(_objects(dataclasses.replace(config, held_backups=4))[3])
    assert env[HELD_BACKUPS_ENV] == "4"
    # worker 0's gang supervisor before every attempt, a recreated gang's first (0) too: no
    # drop (no server is even asked; the chief drops them unless it resumes from them)
    start = _fresh_start({**env, ADDRESSES_ENV: "127.0.0.1:1"}, None, 1, 0.1)
    for attempt in (0, 1):
        start(attempt)
        assert f"attempt {attempt}: the servers keep run " in capsys.readouterr().out


def _mounted_token(tmp_path: Path) -> dict[str, str]:
    """The job's token where this test's 'pods' find it (a pod: the Secret's mount)."""
    path = tmp_path / "token"
    path.write_text("the-jobs-token\n")
    return {TOKEN_FILE_ENV: str(path)}


def test_one_tensorflow_worker_with_restarts_needs_no_horovod(tmp_path):
    """--collectives tensorflow --workers 1 --max-restarts: the gang's server on worker 0
    runs without Horovod (it imported Horovod's rendezvous, failing in such an image)."""
    config = K8sConfig(name="t", image="x", workers=1, servers=0, mode="allreduce",
                       collectives="tensorflow", max_restarts=1,
                       command=(sys.executable, "-c", "print('command ran')"))
    (job,) = [o for o in render(config) if o["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {**_env(container), "PATH": f"{BIN}:/usr/bin:/bin", "JOB_COMPLETION_INDEX": "0",
           RENDEZVOUS_ENV: f"127.0.0.1:{_free_port()}", **_without_horovod(tmp_path),
           **_mounted_token(tmp_path)}
    done = subprocess.run([str(BIN / "parallax"), *container["command"][1:]], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "command ran" in done.stdout


def test_the_gang_server_without_horovod_is_quiet_and_answers_404_elsewhere(capfd):
    """Worker 0's server for the gang alone logs no line per request (every rank polls
    twice a second) and answers another path with 404, not a traceback."""
    import urllib.error
    import urllib.request
    port = _free_port()
    server = k8s.start_rendezvous(port, 2, "127.0.0.1", horovod=False)
    try:
        for _ in range(3):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/elsewhere", timeout=10)
            assert err.value.code == 404
    finally:
        server.shutdown()
        server.server_close()
    out, err_text = capfd.readouterr()
    assert out == "" and err_text == "", (out, err_text)


@pytest.mark.multiprocess
@pytest.mark.parametrize("collectives", ["horovod", "tensorflow"])
def test_gang_bootstrap_restarts_both_ranks_when_one_fails(tmp_path, collectives):
    """(With TensorFlow's collectives worker 0 serves the gang alone: no Horovod.)"""
    results = _gang_pods(tmp_path, 1, {"LAST": "1"}, collectives)
    for rank, (code, out) in results.items():
        assert code == 0, out[-3000:]
        # each attempt's command forked from the pod's warm process (the default with restarts)
        assert f"rank={rank} attempt=0 run=g start=warm" in out, out[-3000:]
        assert f"rank={rank} attempt=1 run=g start=warm" in out, out[-3000:]
    assert "restart 1 of 1" in results[0][1] and "worker 1's command exited with 3" in \
        results[0][1]


@pytest.mark.multiprocess
def test_gang_bootstrap_exits_with_the_failure_once_restarts_are_used(tmp_path):
    results = _gang_pods(tmp_path, 1, {"LAST": "1", "FINAL_CODE": "5"}, warm_starts="off")
    assert {rank: code for rank, (code, _) in results.items()} == {0: 5, 1: 5}
    assert "not restarting" in results[0][1]
    for rank, (_, out) in results.items():  # --warm-starts off: every attempt cold
        assert f"rank={rank} attempt=1 run=g start=cold" in out, out[-3000:]


def test_gang_worker_without_worker_0_exits_so_the_job_recreates_the_pods():
    env = {"HOROVOD_SIZE": "2", "JOB_COMPLETION_INDEX": "1", MAX_RESTARTS_ENV: "2",
           RENDEZVOUS_ENV: f"127.0.0.1:{_free_port()}", RENDEZVOUS_TIMEOUT_ENV: "1",
           "PATH": f"{BIN}:/usr/bin:/bin"}
    out = subprocess.run([str(BIN / "parallax"), "k8s", "worker", "--", "true"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == k8s.gang.LOST_GANG_EXIT, out.stderr
    assert "worker 0" in out.stderr


def test_fresh_start_drops_only_this_runs_tables(tmp_path):
    from parallax.client import PSClient
    from parallax.client.local_cluster import LocalCluster
    from parallax.protocol.specs import TableSpec
    with LocalCluster(2) as cluster, PSClient(cluster.addresses) as client:
        for name in ("run1.v0.emb", "run1.v1.w", "run10.v0.emb"):
            client.create_table(TableSpec(name=name, vocabulary_size=4, dim=1, shard_count=2))
        environ = {"PARALLAX_PS_ADDRESSES": ",".join(cluster.addresses),
                   "PARALLAX_RUN_ID": "run1"}
        k8s._fresh_start(environ, None, 1, 30)(1)
        left = {s.table for reply in client.stats().values() for s in reply.tables}
    assert left == {"run10.v0.emb"}


@pytest.mark.parametrize("value", ["0", "-5", "nan", "soon", "90000"])
def test_a_bad_connect_timeout_names_the_variable_and_the_range(value):
    from parallax.env import connect_timeout
    with pytest.raises(ConfigError, match=rf"{CONNECT_TIMEOUT_ENV}='{value}' must be a number "
                                          r"of seconds in 1-86400 \(default 60\)"):
        connect_timeout({CONNECT_TIMEOUT_ENV: value})


def test_the_connect_timeout_comes_from_the_environment():
    from parallax.env import connect_timeout
    assert connect_timeout({}) == 60.0 and connect_timeout({CONNECT_TIMEOUT_ENV: "600"}) == 600


PATCH = """\
kind: Job
metadata:
  name: wordlm-worker
  labels: {team: ranking}
  annotations: {owner: "ml-platform"}
spec:
  template:
    spec:
      serviceAccountName: trainer
      priorityClassName: high
      imagePullSecrets: [{name: registry-pull}]
      volumes: [{name: data, persistentVolumeClaim: {claimName: ctr-data}}]
      containers:
      - name: worker
        env: [{name: WANDB_MODE, value: offline}, {name: TF_CPP_MIN_LOG_LEVEL, value: "1"}]
        volumeMounts: [{name: data, mountPath: /data, readOnly: true}]
---
kind: StatefulSet
metadata: {name: wordlm-ps}
spec:
  template:
    spec:
      containers:
      - name: log-shipper
        image: fluent/fluent-bit:3.0
        securityContext:
          runAsNonRoot: true
          allowPrivilegeEscalation: false
          capabilities: {drop: [ALL]}
          seccompProfile: {type: RuntimeDefault}
"""


def _container(obj: dict, name: str) -> dict:
    return next(c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def test_patch_files_add_what_real_jobs_need_and_keep_what_was_rendered(tmp_path):
    """--patch: env, volumes, a service account, pull secrets, labels, a priority class and
    a sidecar, merged by name into the rendered objects, which still pass the schemas."""
    from kubernetes_validate import validate
    (tmp_path / "job.yaml").write_text(PATCH)
    plain = CONFIGS["hybrid-4x2"]
    patched = render(dataclasses.replace(plain, patches=(str(tmp_path / "job.yaml"),)))
    before = {(o["kind"], o["metadata"]["name"]): o for o in render(plain)}
    after = {(o["kind"], o["metadata"]["name"]): o for o in patched}
    assert list(before) == list(after)
    job, was = after[("Job", "wordlm-worker")], before[("Job", "wordlm-worker")]
    pod = job["spec"]["template"]["spec"]
    assert (pod["serviceAccountName"], pod["priorityClassName"]) == ("trainer", "high")
    assert pod["imagePullSecrets"] == [{"name": "registry-pull"}]
    assert job["metadata"]["labels"]["team"] == "ranking"
    assert job["metadata"]["labels"].items() >= was["metadata"]["labels"].items()
    env = {e["name"]: e.get("value") for e in _container(job, "worker")["env"]}
    old = {e["name"]: e.get("value") for e in _container(was, "worker")["env"]}
    assert env == {**old, "WANDB_MODE": "offline", "TF_CPP_MIN_LOG_LEVEL": "1"}
    assert _container(job, "worker")["image"] == _container(was, "worker")["image"]
    servers = after[("StatefulSet", "wordlm-ps")]["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in servers] == [c["name"] for c in before[
        ("StatefulSet", "wordlm-ps")]["spec"]["template"]["spec"]["containers"]] + [
        "log-shipper"]
    for obj in patched:
        if not obj["apiVersion"].startswith("monitoring.coreos.com/"):
            for version in K8S_VERSIONS:
                validate(obj, version, strict=True)


@pytest.mark.parametrize("text, words", [
    ("kind: Job\nmetadata: {name: other-worker}\n", ["no rendered object is Job/other-worker",
                                                     "Job/wordlm-worker"]),
    ("- just\n- a list\n", ["a patch must be a mapping"]),
    ("spec: {}\n", ["names its target with `kind` and `metadata.name`"]),
    ("kind: Job\nmetadata: {name: [\n", ["cannot read it as YAML"]),
    # what would break the job rather than carry more of it
    ("kind: Job\nmetadata: {name: wordlm-worker}\nspec: {template: {spec: {containers: "
     "[{image: other}]}}}\n", ["`containers` without its `name`"]),
    ("kind: Job\nmetadata: {name: wordlm-worker, namespace: elsewhere}\n",
     ["changes metadata.namespace of Job/wordlm-worker"]),
    ("kind: StatefulSet\nmetadata: {name: wordlm-ps}\nspec: {template: {metadata: "
     "{labels: null}}}\n", ["changes spec.template.metadata.labels"]),
    ("kind: Job\nmetadata: {name: wordlm-worker}\nspec: {parallelism: 9, completions: 9}\n",
     ["changes spec.parallelism", "--workers"]),
    ("kind: Job\nmetadata: {name: wordlm-worker}\nspec: {template: {spec: {$patch: "
     "delete}}}\n", ["`$patch`", "not supported"]),
    ("# nothing but a comment\n---\n", ["no YAML document"]),
])
def test_a_bad_patch_is_refused_naming_the_file_and_the_fix(tmp_path, text, words):
    (tmp_path / "p.yaml").write_text(text)
    config = dataclasses.replace(CONFIGS["hybrid-4x2"], patches=(str(tmp_path / "p.yaml"),))
    with pytest.raises(ConfigError) as info:
        render(config)
    assert all(w in str(info.value) for w in words), str(info.value)
    assert f"--patch {tmp_path / 'p.yaml'}" in str(info.value)


def test_a_patch_removes_a_key_with_null_and_replaces_plain_lists():
    from parallax.launch.k8s_patch import merge
    base = {"a": {"b": 1, "c": 2}, "args": ["x", "y"], "env": [{"name": "A", "value": "1"}]}
    assert merge(base, {"a": {"c": None}, "args": ["z"], "env": [{"name": "A", "value": "2"}]}
                 ) == {"a": {"b": 1}, "args": ["z"], "env": [{"name": "A", "value": "2"}]}
    assert base["a"] == {"b": 1, "c": 2}  # the rendered objects are not changed in place


def test_the_patch_flag_reaches_the_rendered_yaml(tmp_path, capsys):
    (tmp_path / "job.yaml").write_text(PATCH)
    assert cli.main(["k8s", "--name", "wordlm", "--image", "img", "--workers", "2",
                     "--patch", str(tmp_path / "job.yaml"), "--", "python", "t.py"]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    job = next(o for o in objects if o["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["priorityClassName"] == "high"


def test_patched_lists_merge_by_kubernetes_keys_not_only_by_name(tmp_path):
    """volumeMounts merge by mountPath (a second mount of a volume adds, not moves) and
    ports by containerPort (an unnamed port adds to the server's named ones)."""
    (tmp_path / "p.yaml").write_text(
        "kind: Job\nmetadata: {name: wordlm-worker}\nspec: {template: {spec: {containers: "
        "[{name: worker, volumeMounts: [{name: job-config, mountPath: /opt/cfg}]}]}}}\n"
        "---\nkind: StatefulSet\nmetadata: {name: wordlm-ps}\nspec: {template: {spec: "
        "{containers: [{name: server, ports: [{containerPort: 9100}]}]}}}\n")
    plain = {(o["kind"], o["metadata"]["name"]): o for o in render(CONFIGS["hybrid-4x2"])}
    patched = {(o["kind"], o["metadata"]["name"]): o for o in render(dataclasses.replace(
        CONFIGS["hybrid-4x2"], patches=(str(tmp_path / "p.yaml"),)))}
    mounts = _container(patched[("Job", "wordlm-worker")], "worker")["volumeMounts"]
    was = _container(plain[("Job", "wordlm-worker")], "worker")["volumeMounts"]
    assert mounts == was + [{"name": "job-config", "mountPath": "/opt/cfg"}]
    ports = _container(patched[("StatefulSet", "wordlm-ps")], "server")["ports"]
    old = _container(plain[("StatefulSet", "wordlm-ps")], "server")["ports"]
    assert ports == old + [{"containerPort": 9100}]


def test_secure_certificates_cover_the_addresses_under_another_cluster_domain():
    from parallax.launch import k8s_security
    from parallax.launch.k8s_render import ps_addresses
    config = dataclasses.replace(CONFIGS["hybrid-4x2"], cluster_domain="corp.example")
    names = set(k8s_security.server_names(config))
    assert all(address.rsplit(":", 1)[0] in names for address in ps_addresses(config))
