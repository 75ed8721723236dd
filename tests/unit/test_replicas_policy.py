"""Replicated shards' policy, without servers: which losses a job survives, what is refused,
how the setting travels from `parallax run --replicas` to the workers' ClientOptions."""
from __future__ import annotations

import pytest

from parallax.client.connection import ClientOptions, client_options_from_env
from parallax.client.replicas import check_replicas, survives
from parallax.errors import ConfigError
from parallax.launch.run import parse_args, validate


@pytest.mark.parametrize("lost, servers, replicas, expected", [
    (set(), 3, 1, True), ({0}, 3, 1, False),          # no copies: any loss is fatal
    ({1}, 3, 2, True), ({0}, 2, 2, True),             # one loss: its copies live on
    ({0, 1}, 3, 2, False), ({0, 2}, 3, 2, False),     # neighbours (mod 3): a shard lost
    ({0, 2}, 4, 2, True), ({1, 3}, 4, 2, True),       # every other server: still whole
    ({0, 1}, 2, 2, False), ({0, 1, 2, 3}, 4, 2, False)])
def test_a_job_survives_losses_while_every_shard_keeps_a_copy(lost, servers, replicas,
                                                              expected):
    assert survives(lost, servers, replicas) is expected


@pytest.mark.parametrize("replicas, servers, words", [
    (0, 2, "give 1"), (3, 4, "give 1"), (2, 1, "needs at least 2 servers")])
def test_copies_that_cannot_be_placed_are_refused(replicas, servers, words):
    with pytest.raises(ConfigError, match=words):
        check_replicas(replicas, servers)


def test_the_environment_sets_the_copies_and_bad_values_are_named():
    assert client_options_from_env(environ={"PARALLAX_REPLICAS": "2"}).replicas == 2
    assert client_options_from_env(ClientOptions(replicas=2), environ={}).replicas == 2
    with pytest.raises(ConfigError, match="PARALLAX_REPLICAS='3' must be 1 or 2"):
        client_options_from_env(environ={"PARALLAX_REPLICAS": "3"})


@pytest.mark.parametrize("argv, words", [
    (["--replicas", "2", "--servers", "1"], "--replicas 2: replicas=2 needs at least 2"),
    (["--replicas", "2", "--async"], "with --async"),
    (["--replicas", "3"], "--replicas 3: replicas=3: give 1")])
def test_parallax_run_refuses_copies_it_cannot_keep(argv, words):
    with pytest.raises(ConfigError, match=words):
        validate(parse_args([*argv, "--", "python", "-c", "pass"]))


def test_parallax_run_passes_the_copies_on():
    config = parse_args(["--replicas", "2", "--servers", "3", "--", "python", "-c", "pass"])
    validate(config)
    assert config.replicas == 2


class _Copy:
    """A server holding a copy (the interface of ServerConnection that replicas use): its
    first answer refuses the push as ahead of its open step, and it dies as it is sent again."""

    def __init__(self, address: str, behind: bool) -> None:
        from parallax.client.connection import ClientOptions
        self.address, self.options, self.behind = address, ClientOptions(timeout=5), behind

    def _error(self, code, words: str):
        from parallax.errors import ServerError
        return ServerError(f"Push on server {self.address} failed: {words}",
                           address=self.address, table="t", code=code)

    def future(self, method, request, timeout=None):
        return None

    def result(self, future, method, request, table=None, timeout=None, done_on_retry=(),
               gone=None):
        import grpc
        from parallax.protocol.refusals import STEP_AHEAD
        if self.behind:
            raise self._error(grpc.StatusCode.FAILED_PRECONDITION, f"step 3 {STEP_AHEAD} 2")
        return "applied"

    def call(self, method, request, table=None, timeout=None, done_on_retry=(), pending=None,
             gone=None):
        import grpc
        raise self._error(grpc.StatusCode.UNAVAILABLE, "connection refused")

    def healthy(self, timeout=2.0):
        return False


def test_a_copy_lost_while_it_catches_up_is_left_out_like_any_loss():
    """A copy a push behind is sent the push again until it takes it; if its server dies
    meanwhile (UNAVAILABLE), the push is done on the other copy, as for a loss at the first
    attempt, not failed (while every shard keeps a copy)."""
    from parallax.client.replica_push import CopyConnection
    from parallax.client.replicas import Liveness, ReplicaSet

    liveness = Liveness()
    holder = CopyConnection(_Copy("b:1", behind=True), liveness, lambda: True)
    assert holder.result(None, "PushMany", b"") is None
    assert liveness.lost == {"b:1"}

    liveness = Liveness()
    copies = ReplicaSet([_Copy("a:1", behind=False), _Copy("b:1", behind=True)], liveness)
    assert copies.call("Push", b"", "t") == "applied"
    assert liveness.lost == {"b:1"}


def test_the_stop_after_a_second_loss_names_both_servers(tmp_path):
    # defect: each loss wrote its own reason over the last one's, so the workers' stop (and
    # the launcher's "the job goes on ..." line) named only the second of two lost servers
    from types import SimpleNamespace

    from parallax.env import rescale_reason, rescale_request
    from parallax.launch.run import _rereplication
    stops = tmp_path / "rescale.json"
    ask = _rereplication(stops, 4)
    ask(SimpleNamespace(index=1))
    assert "parameter server 1 started anew, the copies of its shards" in rescale_reason(stops)
    ask(SimpleNamespace(index=3))
    assert "parameter servers 1 and 3 started anew, the copies of their shards" in \
        rescale_reason(stops)
    assert rescale_request(stops) == 4
