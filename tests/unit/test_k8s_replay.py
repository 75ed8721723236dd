"""`parallax k8s --replay-mb N` without processes: the flag, what it renders (every worker's
PARALLAX_REPLAY_MB; each server container's `--restore-newest-on-restart $(PARALLAX_POD_UID)`,
the pod's uid from the downward API, and its data dir), the refusals `parallax run` makes
too, and the rendered server command as `parallax server` parses it.
(tests/server/test_restore_newest.py starts a real server twice on one data dir.)"""
from __future__ import annotations

import dataclasses

import pytest

from parallax.env import MAX_RESTARTS_ENV, REPLAY_ENV
from parallax.errors import ConfigError
from parallax.launch.k8s import DEFAULT_DATA_DIR, MIN_KUBERNETES, K8sConfig, config_from_args, \
    render
from parallax.launch.k8s_render import POD_UID_ENV

CONFIG = K8sConfig(name="rep", image="parallax", command=("python", "t.py"), workers=2,
                   servers=2, replay_mb=64)
RESTART_FLAG = ["--restore-newest-on-restart", f"$({POD_UID_ENV})"]


def _kind(config: K8sConfig, kind: str) -> dict:
    (obj,) = [o for o in render(config) if o["kind"] == kind]
    return obj


def _server(config: K8sConfig) -> dict:
    if config.format == "jobset":
        (job,) = [j for j in _kind(config, "JobSet")["spec"]["replicatedJobs"]
                  if j["name"] == "ps"]
        return job["template"]["spec"]["template"]["spec"]["containers"][0]
    return _kind(config, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]


def _worker_env(config: K8sConfig) -> dict[str, str]:
    (container,) = _kind(config, "Job")["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_the_flag_defaults_to_off_and_is_read():
    argv = ["--name", "rep", "--image", "parallax", "--", "python", "t.py"]
    assert config_from_args(argv)[0].replay_mb == 0
    assert config_from_args(["--replay-mb", "64", *argv])[0].replay_mb == 64


def test_workers_keep_their_pushes_and_servers_restore_on_a_restart_only():
    assert _worker_env(CONFIG)[REPLAY_ENV] == "64"
    server = _server(CONFIG)
    command = server["command"]
    assert command[-2:] == RESTART_FLAG  # the kubelet expands $(VAR) from the env below
    assert "--restore-newest" not in command  # (never on every start)
    assert server["env"] == [{"name": POD_UID_ENV,
                              "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}]
    assert command[command.index("--data-dir") + 1] == DEFAULT_DATA_DIR  # made for it
    pod = _kind(CONFIG, "StatefulSet")["spec"]["template"]["spec"]
    assert {"name": "data", "emptyDir": {}} in pod["volumes"]  # kept across its restarts


def test_a_volume_per_server_and_the_jobset_form_render_it_too():
    claimed = dataclasses.replace(CONFIG, data_volume_size="10Gi", data_dir="/data")
    spec = _kind(claimed, "StatefulSet")["spec"]
    assert spec["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert _server(claimed)["command"][-4:] == ["--data-dir", "/data", *RESTART_FLAG]
    jobset = dataclasses.replace(CONFIG, format="jobset", max_restarts=2)
    assert _server(jobset)["command"][-2:] == RESTART_FLAG
    assert "env" in _server(jobset)


def test_without_the_flag_nothing_changes():
    plain = dataclasses.replace(CONFIG, replay_mb=0)
    assert REPLAY_ENV not in _worker_env(plain)
    server = _server(plain)
    assert "env" not in server and "--restore-newest-on-restart" not in server["command"]
    assert "--data-dir" not in server["command"]  # (no restarts, no volume: none, as before)


def test_with_restarts_a_refused_replay_restarts_the_job():
    both = dataclasses.replace(CONFIG, max_restarts=2)
    env = _worker_env(both)
    assert (env[REPLAY_ENV], env[MAX_RESTARTS_ENV]) == ("64", "2")


def test_the_rendered_server_command_parses_as_parallax_server():
    from parallax_ps.server import parse_args
    command = _server(CONFIG)["command"]
    assert command[:2] == ["parallax", "server"]
    args = [a.replace(f"$({POD_UID_ENV})", "0f3e-uid") for a in command[2:]]
    parsed = parse_args(args)
    assert (parsed.restore_newest_on_restart, parsed.restore_newest, str(parsed.data_dir)) \
        == ("0f3e-uid", False, DEFAULT_DATA_DIR)


@pytest.mark.parametrize("version", (f"{MIN_KUBERNETES}.0", "1.37.0"))
@pytest.mark.parametrize("changes", [{}, {"data_volume_size": "1Gi", "max_restarts": 1},
                                     {"insecure": True}, {"format": "jobset"}])
def test_the_replayed_job_passes_the_kubernetes_schemas(version, changes):
    from kubernetes_validate import validate  # the test extra installs it: never skipped
    for obj in render(dataclasses.replace(CONFIG, **changes)):
        if obj["kind"] != "JobSet":
            validate(obj, version, strict=True)
            continue
        for replicated in obj["spec"]["replicatedJobs"]:  # (the JobSet's own fields:
            job = {"apiVersion": "batch/v1", "kind": "Job",  # tests/unit/test_k8s_jobset)
                   "metadata": {"name": replicated["name"]},
                   "spec": replicated["template"]["spec"]}
            validate(job, version, strict=True)


@pytest.mark.parametrize("changes, words", [
    ({"replay_mb": -1}, r"--replay-mb -1 must be an integer >= 0"),
    ({"replay_mb": True}, r"--replay-mb True must be an integer >= 0"),
    ({"replicas": 2}, r"--replay-mb 64 with --replicas 2: give one"),
    ({"sync": False}, r"--replay-mb 64 with --async: a replay rebuilds a shard exactly only "
                      r"from sync steps"),
    ({"servers": 0, "mode": "allreduce"}, r"--replay-mb 64 with --servers 0: there is no "
                                          r"parameter server to replay to"),
    ({"server_args": ("--restore-newest",)}, r"--server-arg '--restore-newest': .*give "
                                             r"--replay-mb N"),
    ({"server_args": ("--restore-newest-on-restart=x",), "replay_mb": 0},
     r"--server-arg '--restore-newest-on-restart=x': .*on its first start too"),
])
def test_what_it_cannot_do_is_refused_with_the_fix(changes, words):
    with pytest.raises(ConfigError, match=words):
        render(dataclasses.replace(CONFIG, **changes))
