"""The `single` launch backend: one worker on this machine runs the program itself.

No rank, no Horovod: the worker keeps the launcher's terminal for stdout, and its exit code
is the job's.
"""
from __future__ import annotations

from parallax.launch.backends.base import WorkerBackend
from parallax.launch.hosts import ClusterLayout, is_local


class Single(WorkerBackend):
    name = "single"
    who = "worker rank 0"
    pipes_stdout = False

    def accepts(self, layout: ClusterLayout, num_workers: int, collectives: str = "auto"
                ) -> bool:
        return num_workers == 1 and is_local(layout.hosts[0].host)

    def argv(self, layout: ClusterLayout, num_workers: int, program: list[str],
             extra_args: tuple[str, ...] = ()) -> list[str]:
        return list(program)  # --horovodrun-arg's are checked, and unused with one worker

