"""Requests waiting for room under `--memory-mb` that only wait on each other (each keeps the
body it received while it waits, and between them they hold the room none of them fits in)
are not left waiting until their deadlines: the one that completes the stall is refused at
once, which gives its room back to the others (servers/parallax_ps/budget.py `_stalled`).
In-process budgets."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from parallax_ps.budget import MemoryBudget
from parallax_ps.errors import RequestError


def _waiting(budget: MemoryBudget, nbytes: int, own: int, out: list) -> threading.Thread:
    """A request holding `own` that asks for `nbytes` more, on a thread of its own."""
    def run() -> None:
        start = time.monotonic()
        try:
            out.append((budget.hold(nbytes, start + 30, "a push", own=own),
                        time.monotonic() - start))
        except RequestError as exc:
            out.append((exc, time.monotonic() - start))
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_requests_that_wait_only_on_each_other_are_let_go_at_once():
    budget = MemoryBudget(100, 0)
    assert budget.hold(30, time.monotonic(), "first body")
    assert budget.hold(30, time.monotonic(), "second body")  # 40 left
    first: list = []
    waiter = _waiting(budget, 50, 30, first)
    time.sleep(0.3)
    assert not first  # the second request is at work: it may give its 30 back
    with pytest.raises(RequestError) as refused:  # now both wait, and neither fits
        budget.hold(50, time.monotonic() + 30, "a push", own=30)
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waiting for room" in refused.value.message and "--memory-mb" in \
        refused.value.message
    budget.unhold(30)  # the refused request's body goes: the first fits
    waiter.join(10)
    assert first and first[0][0] is True and first[0][1] < 5, first
    budget.unhold(80)
    assert budget.held == 0


def test_a_waiter_that_would_fit_keeps_the_others_waiting():
    """Two wait; the room one of them needs is there once the request at work is done: the
    other, woken first, does not give up (nothing is stalled while someone fits)."""
    budget = MemoryBudget(100, 0)
    assert budget.hold(40, time.monotonic(), "at work")
    assert budget.hold(10, time.monotonic(), "small body")
    assert budget.hold(10, time.monotonic(), "large body")  # 40 left
    small, large = [], []
    threads = [_waiting(budget, 45, 10, small), _waiting(budget, 85, 10, large)]
    time.sleep(0.3)
    assert not small and not large
    budget.unhold(40)  # 80 left: the small one fits, the large one never can beside it
    threads[0].join(10)
    assert small and small[0][0] is True, small
    budget.unhold(55)  # the small request is done: the large one fits
    threads[1].join(10)
    assert large and large[0][0] is True, large
    budget.unhold(95)
    assert budget.held == 0
