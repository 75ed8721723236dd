"""How a held checkpoint's state is split over the servers and found whole again
(`parallax.client.held_state`)."""
from __future__ import annotations

import pytest

from parallax.client.held_state import (STATE_MARGIN_BYTES, Listed, holders, joined,
                                        newest_complete, piece_limit, split)
from parallax.errors import ConfigError


def test_split_makes_a_piece_per_server_at_least_and_none_over_the_limit():
    state = bytes(range(256)) * 40  # 10240 bytes
    for servers, limit, count in ((3, 1 << 20, 3), (2, 1000, 11), (1, 10240, 1)):
        pieces = split(state, servers, limit)
        assert len(pieces) == count and b"".join(pieces) == state
        assert max(map(len, pieces)) <= limit
        assert max(map(len, pieces)) - min(map(len, pieces)) <= count  # even
    assert split(b"ab", 3, 10) == [b"a", b"b", b""]
    with pytest.raises(ConfigError, match="state is empty"):
        split(b"", 2, 10)


def test_holders_are_the_piece_server_and_with_replicas_the_next_among_those_marked():
    assert holders(4, [0, 1, 2], 1) == [1]
    assert holders(2, [0, 1, 2], 2) == [0, 2]
    assert holders(0, [0], 1) == [0]
    assert holders(3, [1, 3], 2) == [1, 3]  # servers 0 and 2 hold no shard of the tables
    assert holders(0, [2], 2) == [2]


def test_a_piece_fits_the_smallest_message_with_its_fields():
    assert piece_limit(4 << 20, 1 << 20, 200) == (1 << 20) - 200 - STATE_MARGIN_BYTES
    assert piece_limit(10000, 8 << 20, 100) == 10000 - 100 - STATE_MARGIN_BYTES
    assert piece_limit(10, 10, 100) == 1


def _listed(name: str, index: int, count: int) -> Listed:
    return Listed(name, index, count, 1)


def test_the_newest_checkpoint_whole_on_the_live_servers_is_found():
    old, new = "ckpt-00000000000000000001-aaaa0000", "ckpt-00000000000000000002-aaaa0000"
    listed = [(0, _listed(old, 0, 2)), (1, _listed(old, 1, 2)), (0, _listed(new, 0, 2)),
              (2, _listed(new, 0, 2))]
    assert newest_complete(listed) == (old, {0: [0], 1: [1]})  # the newest misses piece 1
    listed.append((2, _listed(new, 1, 2)))
    assert newest_complete(listed) == (new, {0: [0, 2], 1: [2]})
    assert newest_complete([(0, _listed(old, 0, 2)), (1, _listed(old, 1, 3))]) is None
    assert newest_complete([]) is None


def test_joined_needs_every_piece():
    assert joined({1: b"b", 0: b"a"}, 2, "c") == b"ab"
    with pytest.raises(ConfigError, match=r"held checkpoint c's state misses pieces \[1\] of 2"):
        joined({0: b"a"}, 2, "c")
