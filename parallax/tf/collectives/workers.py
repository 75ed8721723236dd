"""What every collectives backend is: who a worker is among its peers (`WorkerInfo`), the six
things the strategy asks of its peers (`Workers`, the interface each backend implements), and
work whose failure on one worker every worker raises (`on_every_worker`, `on_chief`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from parallax.errors import ParallaxError


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


class Workers(Protocol):
    """A worker's peers: who am I, sum these gradients (as one fused group, in the graph),
    all-gather a tensor over this host's workers (local aggregation), gather rows (sparse
    gradients in the `allreduce` run mode, predictions), copy rank 0's variables, and exchange
    small Python objects (plans, to check that workers agree)."""

    info: WorkerInfo

    def allreduce_sum(self, tensors: Sequence[Any]) -> list[Any]: ...

    def local_allgather(self, tensor: Any) -> Any: ...

    def allgather_rows(self, tensors: Sequence[Any]) -> list[Any]: ...

    def broadcast_variables(self, variables: Sequence[Any]) -> None: ...

    def allgather_object(self, obj: Any) -> list[Any]: ...

    def broadcast_object(self, obj: Any) -> Any: ...


def on_every_worker(workers: Workers, work: Callable[[], None], failed: str) -> None:
    """Run `work` here; if it fails on any worker, every worker raises (none is left
    waiting in the next collective for a peer that gave up). `failed` completes
    "worker R ...: <error>" in the message the others raise."""
    error = None
    try:
        work()
    except Exception as exc:  # noqa: BLE001 - shared with the peers, then re-raised
        error = exc
    messages = workers.allgather_object(None if error is None else f"{error}")
    if error is not None:
        raise error
    for rank, message in enumerate(messages):
        if message is not None:
            raise ParallaxError(f"worker {rank} {failed}: {message}")


def on_chief(workers: Workers, work: Callable[[], None], failed: str) -> None:
    """`work` on rank 0 only; the others wait for it, and raise its error if it fails."""
    on_every_worker(workers, work if workers.info.is_chief else (lambda: None), failed)
