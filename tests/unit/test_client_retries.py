"""Client retries after UNAVAILABLE: doubled waits with jitter, so the workers a restarted
server refused do not all retry in the same instant (fast tier: arithmetic only)."""
from __future__ import annotations

import random

from parallax.client.connection import retry_delay


def test_each_wait_doubles_and_is_jittered_to_half_or_more():
    for attempt, base in ((1, 0.2), (2, 0.4), (3, 0.8)):
        assert retry_delay(0.2, attempt, draw=lambda: 0.0) == base / 2
        assert retry_delay(0.2, attempt, draw=lambda: 1.0) == base


def test_workers_retrying_together_spread_out():
    rng = random.Random(7)
    waits = [retry_delay(0.2, 1, draw=rng.random) for _ in range(64)]
    assert all(0.1 <= w <= 0.2 for w in waits)
    assert max(waits) - min(waits) > 0.05 and len(set(waits)) == 64


def test_workers_that_seed_the_global_random_alike_still_jitter_apart():
    """Training scripts seed `random` alike on every worker: the jitter has its own draw."""
    random.seed(1234)
    first = [retry_delay(0.2, 1) for _ in range(8)]
    random.seed(1234)
    second = [retry_delay(0.2, 1) for _ in range(8)]
    assert first != second
