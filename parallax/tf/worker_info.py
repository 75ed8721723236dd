"""Who a worker is among its peers: rank, size, and the same on its host."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerInfo:
    rank: int
    size: int
    local_rank: int
    local_size: int
    host: str

    @property
    def is_chief(self) -> bool:
        return self.rank == 0
