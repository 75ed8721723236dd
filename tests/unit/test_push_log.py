"""The push log of replayed servers (`parallax.client.replay.PushLog`): which kept pushes a
server started again from a checkpoint needs, in order, and the refusals when they do not
reach back to its step or cannot be split. Requests are real encodings (bulk_codec,
packed_codec); no server, no TensorFlow."""
from __future__ import annotations

import numpy as np
import pytest

from parallax.client.replay import PushLog, ReplayError
from parallax.protocol import bulk_codec
from parallax.protocol.bulk_codec import PushHeader
from parallax.protocol.packed_codec import PushManyParts, decode_push_many

IDS = np.arange(3, dtype=np.int64)


def _push(table: str, shard: int, step: int) -> bytes:
    return bulk_codec.encode_push_request(table, shard, step, 0, IDS,
                                          np.ones((3, 2), np.float32))


def _push_many(*parts: tuple[str, int, int]) -> PushManyParts:
    headers = [(PushHeader(t, shard, step, 0, 0.0, 0, 1, 0), 3, 2, np.dtype(np.float32))
               for t, shard, step in parts]

    def fill(i: int, ids: np.ndarray, rows: np.ndarray) -> None:
        ids[...], rows[...] = IDS, float(parts[i][2])
    return PushManyParts(headers, fill)


def test_a_server_restored_at_a_step_gets_every_kept_push_from_it_in_order():
    log = PushLog(1 << 20)
    for step in range(4):
        log.keep("PushMany", _push_many(("a", 0, step), ("b", 1, step)))
        log.keep("Push", _push("c", 0, step))
    again = log.since({("a", 0): 2, ("b", 1): 2, ("c", 0): 3}, "h:1")
    got = [[(t, s, step) for t, s, step in _parts(m, r)] for m, r in again]
    assert got == [[("a", 0, 2), ("b", 1, 2)], [("a", 0, 3), ("b", 1, 3)], [("c", 0, 3)]]
    assert log.since({("a", 0): 4, ("b", 1): 4, ("c", 0): 4}, "h:1") == []


def test_the_pushes_only_of_deleted_tables_are_not_sent_again():
    log = PushLog(1 << 20)
    for step in range(2):
        log.keep("Push", _push("gone", 0, step))
        log.keep("PushMany", _push_many(("a", 0, step), ("gone", 1, step)))
        log.keep("Push", _push("a", 1, step))
    again = log.since({("a", 0): 0, ("a", 1): 0}, "h:1", deleted={"gone"})
    got = [[(t, s, step) for t, s, step in _parts(m, r)] for m, r in again]
    assert got == [[("a", 0, 0), ("gone", 1, 0)], [("a", 1, 0)],
                   [("a", 0, 1), ("gone", 1, 1)], [("a", 1, 1)]]  # (mixed ones stay)


def test_a_kept_request_no_longer_reads_the_arrays_it_was_made_from():
    grads = np.ones((3, 2), np.float32)
    request = PushManyParts([(PushHeader("a", 0, 0, 0, 0.0, 0, 1, 0), 3, 2,
                              np.dtype(np.float32))],
                            lambda i, ids, rows: (ids.__setitem__(..., IDS),
                                                  rows.__setitem__(..., grads)))
    log = PushLog(1 << 20)
    kept = log.keep("PushMany", request)
    grads[...] = 7.0  # (a worker reuses its gradient buffers at the next step)
    part, = decode_push_many(kept.packed()).parts
    np.testing.assert_array_equal(part.grads, np.ones((3, 2), np.float32))


def test_pushes_dropped_for_room_or_never_kept_refuse_a_replay():
    log = PushLog(1)  # room for the newest push only
    for step in range(3):
        log.keep("Push", _push("a", 0, step))
    assert log.dropped == 2 and len(log.entries) == 1
    with pytest.raises(ReplayError, match="only from step 2: it dropped 2 older push"):
        log.since({("a", 0): 1}, "h:1")
    assert len(log.since({("a", 0): 2}, "h:1")) == 1  # what it kept is enough from step 2
    fresh = PushLog(1 << 20)
    fresh.keep("Push", _push("a", 0, 5))  # a worker that started (resumed) at step 5
    with pytest.raises(ReplayError, match="it started after that checkpoint"):
        fresh.since({("a", 0): 3}, "h:1")


def test_a_push_with_parts_on_both_sides_of_the_servers_steps_is_refused():
    log = PushLog(1 << 20)
    log.keep("PushMany", _push_many(("a", 0, 3), ("b", 0, 1)))
    with pytest.raises(ReplayError, match="both applied and not applied"):
        log.since({("a", 0): 3, ("b", 0): 2}, "h:1")


def _parts(method: str, request):
    from parallax.client.replay import _steps
    return _steps(method, request)


def test_pushes_from_before_a_rollback_are_not_sent_again():
    """A restore took the tables back to step 1: the steps taken again since replace the
    ones kept from before it."""
    log = PushLog(1 << 20)
    for step in (0, 1, 2, 3, 1, 2):
        log.keep("Push", _push("a", 0, step))
    again = log.since({("a", 0): 1}, "h:1")
    assert [_parts(m, r)[0][2] for m, r in again] == [1, 2]
    assert all(r is e[1] for (_, r), e in zip(again, list(log.entries)[4:]))
