"""Held copies count against --memory-mb: copies that would take the server past it are
dropped (a resume from those marks restores from disk) instead of crowding out other tables'
pushes (found by review: they were counted after the fact, never checked)."""
from __future__ import annotations

import numpy as np

from parallax.protocol.specs import Adam, Initializer, TableSpec
from parallax_ps.budget import MemoryBudget
from parallax_ps.shard import TableShard

MB = 1 << 20


def _spec(name: str) -> TableSpec:
    return TableSpec(name=name, vocabulary_size=30000, dim=16, shard_count=1, num_workers=2,
                     optimizer=Adam(0.01), initializer=Initializer("normal", seed=1))


def test_held_copies_stay_within_the_memory_budget(caplog):
    budget = MemoryBudget(16 * MB)  # two 5.5 MiB tables fit, and 5 MiB more
    a, b = TableShard(_spec("a"), 0, budget), TableShard(_spec("b"), 0, budget)
    ids, rng = np.arange(30000), np.random.default_rng(0)
    a.hold("m0")
    for step in range(3):
        for worker in (0, 1):
            a.push(step, worker, ids, rng.normal(size=(30000, 16)).astype(np.float32), 0.01)
        assert budget._total <= budget.limit, (budget._total / MB, a.held.nbytes / MB)
        a.hold(f"m{step + 1}")  # a held backup every step (PSClient.save(held=True), keep 2)
        a.keep_held(2)
    assert "would take this server past --memory-mb; dropped them" in caplog.text
    b.push(0, 0, ids[:10], np.ones((10, 16), np.float32), 0.01)  # room for the other table
    small = TableShard(_spec("c"), 0, MemoryBudget(64 * MB))
    small.hold("m")  # with room: kept
    small.push(0, 0, ids[:10], np.ones((10, 16), np.float32), 0.01)
    small.push(0, 1, ids[:10], np.ones((10, 16), np.float32), 0.01)
    assert small.held.names() == ["m"] and small.held.nbytes > 0
