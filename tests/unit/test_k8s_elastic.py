"""An elastic worker count in `parallax k8s` (--min-np, --max-np, --elastic-timeout), without
processes: what the worker Job renders (its sizes, every pod's environment, the
podFailurePolicy, worker 0's rendezvous port), the refusals that name their fix, and worker
0's gang following the pods there (parallax.launch.gang.Scaling) on a fake clock: an attempt
opens with the pods that came, a pod that comes or leaves makes it ask the commands to stop
at their next checkpoint, and such a stop uses none of --max-restarts.
(tests/integration/test_chaos.py runs the pods for real.)"""
from __future__ import annotations

import dataclasses
import json

import pytest

from parallax.env import note_global_batch, note_rescale_stop, rescale_request
from parallax.errors import ConfigError
from parallax.launch import gang
from parallax.launch.k8s import MIN_KUBERNETES, K8sConfig, config_from_args, render
from parallax.launch.restarts import RestartBudget

CONFIG = K8sConfig(name="ela", image="parallax", command=("python", "t.py"), workers=1,
                   servers=2, min_workers=1, max_workers=3, elastic_timeout=90)


def _job(config: K8sConfig) -> dict:
    (job,) = [o for o in render(config) if o["kind"] == "Job"]
    return job


def _env(job: dict) -> dict[str, str]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_an_elastic_job_starts_with_workers_and_tells_the_pods_its_bounds():
    job = _job(CONFIG)
    spec = job["spec"]
    assert (spec["completions"], spec["parallelism"]) == (1, 1)  # -np: scaled by a patch
    assert spec["backoffLimit"] == 0  # no --max-restarts: N x the most pods = 0
    assert spec["podFailurePolicy"]["rules"][1]["onExitCodes"]["values"] == \
        [gang.LOST_GANG_EXIT]  # (rendered for the gang, even without --max-restarts)
    env = _env(job)
    assert (env[gang.MIN_WORKERS_ENV], env[gang.MAX_WORKERS_ENV],
            env[gang.ELASTIC_TIMEOUT_ENV]) == ("1", "3", "90")
    assert env["PARALLAX_RENDEZVOUS"].startswith("ela-worker-0.ela-workers.default.svc")
    assert env["HOROVOD_SIZE"] == "1"  # (the template's; each attempt gets its own)
    (container,) = spec["template"]["spec"]["containers"]
    assert {"name": "rendezvous", "containerPort": 7070} in container["ports"]
    (config,) = [o for o in render(CONFIG) if o["kind"] == "ConfigMap"]
    sizes = json.loads(config["data"]["job.json"])
    assert (sizes["workers"], sizes["min_workers"], sizes["max_workers"]) == (1, 1, 3)


def test_restarts_of_an_elastic_job_count_gangs_of_the_most_pods():
    spec = _job(dataclasses.replace(CONFIG, workers=2, max_restarts=2))["spec"]
    assert (spec["completions"], spec["backoffLimit"]) == (2, 6)


@pytest.mark.parametrize("bounds", [{}, {"min_workers": 2, "max_workers": 2}])
def test_bounds_equal_to_workers_render_the_fixed_job_as_before(bounds):
    fixed = K8sConfig(name="ela", image="parallax", command=("python", "t.py"), workers=2,
                      token_secret="ela-token")  # (no generated token: renders alike)
    assert render(dataclasses.replace(fixed, **bounds)) == render(fixed)
    assert gang.MAX_WORKERS_ENV not in _env(_job(fixed))
    assert "podFailurePolicy" not in _job(fixed)["spec"]


@pytest.mark.parametrize("version", (f"{MIN_KUBERNETES}.0", "1.37.0"))
@pytest.mark.parametrize("changes", [{}, {"max_restarts": 1, "held_backups": 2},
                                     {"insecure": True}])
def test_the_elastic_job_passes_the_kubernetes_schemas(version, changes):
    from kubernetes_validate import validate  # the test extra installs it: never skipped
    for obj in render(dataclasses.replace(CONFIG, **changes)):
        validate(obj, version, strict=True)


@pytest.mark.parametrize("changes, words", [
    ({"min_workers": 2}, r"--min-np 2, --workers 1, --max-np 3: need 1 <= --min-np <= "
                         r"--workers <= --max-np"),
    ({"workers": 4}, r"--min-np 1, --workers 4, --max-np 3"),
    ({"min_workers": 0}, r"--min-np 0, --workers 1"),
    ({"max_workers": True}, r"--max-np True must be an integer"),
    ({"elastic_timeout": 0}, r"--elastic-timeout 0 must be seconds"),
    ({"elastic_timeout": float("nan")}, r"--elastic-timeout nan must be seconds"),
    ({"collectives": "tensorflow"}, r"with --collectives tensorflow: .*give --collectives "
                                    r"horovod"),
    ({"format": "jobset"}, r"with --format jobset: .*cannot be scaled; give --format job"),
])
def test_bad_bounds_are_refused_with_the_fix(changes, words):
    with pytest.raises(ConfigError, match=words):
        render(dataclasses.replace(CONFIG, **changes))


def test_the_flags_are_parallax_runs():
    config, _ = config_from_args(["--name", "ela", "--image", "img", "-np", "2", "--min-np",
                                  "1", "--max-np", "4", "--elastic-timeout", "30", "--",
                                  "python", "t.py"])
    assert (config.workers, config.min_workers, config.max_workers,
            config.elastic_timeout) == (2, 1, 4, 30)


# Worker 0's gang, elastic, on a fake clock.

class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _gang(tmp_path, max_restarts=0, least=1, most=3):
    clock, said, started = _Clock(), [], []
    scaling = gang.Scaling(least, tmp_path / "rescale.json", timeout=30, settle=2)
    g = gang.Gang(most, RestartBudget(max_restarts, 0, said.append), started.append,
                  timeout=5, clock=clock, say=said.append, scaling=scaling)
    return g, clock, said, started


def _tick(g, clock, seconds, *ranks):
    """`seconds` pass, the supervisors of `ranks` polling, worker 0 stepping."""
    for _ in range(int(seconds / 0.5)):
        clock.now += 0.5
        for rank in ranks:
            g.poll(rank)
        g.step()


def _stop_at_checkpoint(g, clock, *ranks):
    """The chief stops after its checkpoint as asked: every command exits RESCALE_EXIT."""
    note_rescale_stop(g.scaling.request, "epoch 2")
    for rank in ranks:
        g.report(rank, g.attempt, 75)
    g.step()
    g.step()


def test_the_gang_follows_the_pods_up_and_down_without_using_a_restart(tmp_path):
    g, clock, said, started = _gang(tmp_path)
    _tick(g, clock, 1, 0)
    assert g.state == "starting"  # it waits SETTLE_S for more pods
    _tick(g, clock, 2, 0)
    assert (g.state, g.members, started) == ("running", [0], [0])
    assert g.poll(0) == {"attempt": 0, "state": "running", "code": 0, "rank": 0, "size": 1,
                         "kept": False}
    assert g.poll(1)["rank"] == -1  # a new pod waits for the next attempt
    g.step()
    assert rescale_request(g.scaling.request) == 2 and "to go on with 2" in said[-1]
    _stop_at_checkpoint(g, clock, 0)
    assert (g.state, g.attempt) == ("starting", 1) and "using none of the restarts" in said[-1]
    _tick(g, clock, 0.5, 0, 1)  # (the count it stopped for is there: no wait for more)
    assert (g.state, g.members) == ("running", [0, 1])
    assert rescale_request(g.scaling.request) is None  # (the request is withdrawn)
    assert {r: g.poll(r)["rank"] for r in (0, 1)} == {0: 0, 1: 1}
    g.leave(1)  # its supervisor got SIGTERM: the Job scaled down
    g.step()
    assert rescale_request(g.scaling.request) == 1
    g.report(1, 1, 143)  # its command died before the checkpoint (the pod's grace ran out)
    g.step()
    assert g.state == "aborting" and "announced it leaves" in g.cause
    g.report(0, 1, 1)
    g.step()
    assert (g.state, g.attempt, g.budget.restarts) == ("starting", 2, 0)
    _tick(g, clock, 0.5, 0)
    assert (g.state, g.members) == ("running", [0])
    g.report(0, 2, 0)
    g.step()
    assert g.poll(0)["state"] == "done" and g.everyone_told()


def test_a_failure_of_a_pod_that_did_not_leave_uses_a_restart(tmp_path):
    g, clock, said, _ = _gang(tmp_path)
    _tick(g, clock, 2.5, 0, 1)
    g.report(1, 0, 3)
    g.step()
    g.report(0, 0, 143)
    g.step()
    assert (g.state, g.code) == ("failed", 3) and "all 0 restart(s)" not in said[-1]


def test_an_attempt_runs_a_count_that_splits_the_global_batch(tmp_path):
    g, clock, said, _ = _gang(tmp_path)
    note_global_batch(g.scaling.request, 4)
    _tick(g, clock, 2.5, 0, 1, 2)
    assert g.members == [0, 1]  # 3 do not split 4; pod 2 waits
    assert g.poll(2)["rank"] == -1


def test_the_gang_fails_after_the_elastic_timeout_without_min_np_pods(tmp_path):
    g, clock, said, _ = _gang(tmp_path, least=2)
    _tick(g, clock, 31, 0)
    assert (g.state, g.code) == ("failed", 1)
    assert "1 worker pod(s) came within --elastic-timeout 30 s; --min-np 2 needs 2" in said[-1]


def test_bounds_whose_counts_never_split_the_global_batch_fail_at_once(tmp_path):
    """Before: the gang waited the whole --elastic-timeout, then said too few pods came."""
    g, clock, said, _ = _gang(tmp_path, least=3, most=4)
    note_global_batch(g.scaling.request, 10)  # neither 3 nor 4 splits it
    _tick(g, clock, 1, 0, 1, 2, 3)
    assert (g.state, g.code) == ("failed", 1)
    assert "no worker count from --min-np 3 to --max-np 4 splits the global batch 10" in said[-1]


def test_pods_there_that_do_not_split_the_batch_are_named_at_the_timeout(tmp_path):
    g, clock, said, _ = _gang(tmp_path, least=3, most=4)
    note_global_batch(g.scaling.request, 8)  # 4 would split it; 3 pods came
    _tick(g, clock, 31, 0, 1, 2)
    assert g.state == "failed"
    assert "3 worker pod(s) came within --elastic-timeout 30 s, but only 2 of them split the " \
        "global batch 8" in said[-1]


def test_a_pod_that_comes_and_leaves_before_the_stop_withdraws_it(tmp_path):
    """Before: the stop asked for stayed, and the running attempt stopped for nothing."""
    g, clock, said, _ = _gang(tmp_path)
    _tick(g, clock, 2.5, 0)
    _tick(g, clock, 0.5, 0, 1)
    assert rescale_request(g.scaling.request) is not None
    g.leave(1)
    _tick(g, clock, 6, 0)
    assert rescale_request(g.scaling.request) is None and g.asked is None
    assert "the stop asked for is withdrawn" in said[-1]


def test_without_worker_0_no_attempt_opens(tmp_path):
    g, clock, said, _ = _gang(tmp_path)
    _tick(g, clock, 3, 1)
    assert g.state == "starting"
    _tick(g, clock, 30, 1)
    assert g.state == "failed" and "worker 0 among them" in said[-1]


def test_a_rank_beyond_max_np_is_refused(tmp_path):
    g, *_ = _gang(tmp_path)
    with pytest.raises(gang.GangRequestError, match=r"rank 3 is not a rank of this gang"):
        g.poll(3)


def test_a_pod_beyond_max_np_ends_with_0_without_training(capsys):
    from parallax.launch.k8s_bootstrap import worker_main
    env = {gang.MIN_WORKERS_ENV: "1", gang.MAX_WORKERS_ENV: "2", "JOB_COMPLETION_INDEX": "2",
           "PARALLAX_RENDEZVOUS": "localhost:1"}
    assert worker_main(["false"], env) == 0
    assert "index 2 is beyond the job's --max-np 2" in capsys.readouterr().out
