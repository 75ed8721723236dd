"""The launch backends' interface (see `parallax.launch.backends`)."""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parallax.launch.hosts import ClusterLayout


class WorkerBackend(abc.ABC):
    """Starts every worker of a job with one command."""

    name: str = ""
    who: str = ""                  # who exited, when the command's own exit code says it
    pipes_stdout: bool = True      # False: the workers keep the launcher's stdout (a terminal)

    @abc.abstractmethod
    def accepts(self, layout: ClusterLayout, num_workers: int, collectives: str = "auto"
                ) -> bool:
        """Whether this backend can start `num_workers` workers on `layout` whose dense
        gradients go through `collectives` (`parallax run --collectives`: auto, horovod or
        tensorflow)."""

    @abc.abstractmethod
    def argv(self, layout: ClusterLayout, num_workers: int, program: list[str],
             extra_args: tuple[str, ...] = ()) -> list[str]:
        """The command that starts the workers (`extra_args`: --horovodrun-arg's, for a
        backend that takes them); raises ConfigError when it cannot be made."""

    def forwarded(self, env: dict[str, str]) -> dict[str, str]:
        """What a worker on another host gets of the launcher's environment `env` (the rest
        is that host's own: `parallax.launch.warm_remote` matches it)."""
        return dict(env)

    def rank_line(self, line: bytes) -> tuple[int, bytes] | None:
        """(rank, text) when an output line is a worker's, marked with its rank."""
        return None

    def failure(self, line: bytes) -> tuple[int, int] | None:
        """(rank, exit code) when an output line reports a worker that failed."""
        return None
