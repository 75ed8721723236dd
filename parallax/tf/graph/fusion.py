"""Step fusion, the graph-rewriting layer: one pull op and one push op per training step.

While the strategy traces a step (`strategy.run` inside a `tf.function`), a `StepFusion`
watches every lookup of a table on the servers and every update the optimizer hands it:

- A lookup traced in the step's own graph whose ids do not depend on the rows of a lookup
  already grouped is *grouped*: it emits a placeholder op for its rows (stateless, never
  run) and the rest of the step is traced against that.
- Other lookups keep the single-table path, with the reason: inside a nested graph (a
  `tf.cond` branch, a `while_loop` body, a nested `tf.function`), ids that depend on grouped
  rows (a cycle), or an eager step.
- When the step has been traced, `finish` adds one fused pull op taking every grouped
  lookup's unique ids, rewires each placeholder's consumers to the fused op's outputs, and
  adds one push op carrying every table's gradient (empty pushes for tables the step did not
  update: a sync step must hear from every worker).

Ordering: the fused pull is created last but must run first, so it is stateless to
TensorFlow (automatic control dependencies would otherwise order it after the step's own
pushes, which depend on it). It takes a *ticket*: the output of a stateful op made when the step
starts (TensorFlow's `Timestamp`: no Python callback; its value is not read), which
automatic control dependencies order after everything stateful traced before the step (the
previous step's push, where several steps share one graph). The ticket
also keeps TensorFlow from treating a pull of constant ids (a whole-variable read) as a
constant: shape inference and constant folding never run it at trace time.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import numpy as np
import tensorflow as tf

from parallax.client.step import FusedPull, FusedPush, StepRouting

if TYPE_CHECKING:
    from parallax.client.table_client import TableClient
    from parallax.tf.graph.remote import RemoteTable


@dataclasses.dataclass(frozen=True)
class LookupReport:
    """How one lookup of a table on the servers travels in the traced step."""

    variable: str
    fused: bool
    reason: str


@dataclasses.dataclass
class _Lookup:
    remote: RemoteTable
    unique: tf.Tensor
    placeholder: tf.Tensor


class StepFusion:
    """The lookups and pushes of one traced step, in the graph `graph`."""

    def __init__(self, graph, client: TableClient | None = None) -> None:
        self.graph = graph
        self.client = client  # what the fused pull and push send through (None: direct)
        # a stateful op of TensorFlow's own (no Python callback per step); its value, the
        # time, is never read
        self.ticket = tf.raw_ops.Timestamp(name="parallax_step_begins")
        self.reports: list[LookupReport] = []
        self._grouped: list[_Lookup] = []
        self._placeholder_ops: set = set()
        self._clean: set = set()  # ops known not to depend on any placeholder
        self._pushes: dict[int, tuple[RemoteTable, tf.Tensor, tf.Tensor, tf.Tensor]] = {}
        self._routing = StepRouting()  # the pull's routing, for a push of the same ids

    # ---- while the step is traced ----

    def lookup(self, remote: RemoteTable, unique: tf.Tensor) -> tf.Tensor | None:
        """The rows of `unique` as a placeholder the fused pull will feed, or None when this
        lookup must keep its own pull (the reason is reported)."""
        reason = self._why_not(unique)
        self.reports.append(LookupReport(remote.label, reason is None,
                                         reason or "grouped with the step's other lookups"))
        if reason is not None:
            return None
        rows = tf.numpy_function(_unfed(remote), [unique, self.ticket], remote.dtype,
                                 stateful=False, name="parallax_pull_pending")
        self._grouped.append(_Lookup(remote, unique, rows))
        self._placeholder_ops.add(rows.op)
        return rows

    def _why_not(self, unique: tf.Tensor) -> str | None:
        if tf.compat.v1.get_default_graph() is not self.graph or unique.graph is not self.graph:
            return "traced in a nested graph (tf.cond, while_loop or a nested " \
                   "tf.function), which has its own pull"
        blocker = self._grouped_ancestor(unique.op)
        if blocker is not None:
            return f"its ids depend on the rows of {blocker!r}, pulled in the " \
                   f"same fused request"
        return self._ordered_after_rows(unique.op)

    def _ordered_after_rows(self, op) -> str | None:
        """Why the ids of `op` may come after grouped rows once TensorFlow orders the step's
        stateful ops (automatic control dependencies, added when the function is built): a
        stateful op traced in the step that the ids depend on is run after the stateful ops
        traced before it; if one of those used grouped rows, grouping these ids would make
        the fused pull wait for itself (a cycle)."""
        begins = self.ticket.op._id  # noqa: SLF001 - creation order is program order
        latest = None
        for current in self._upstream(op):
            if current._is_stateful and current._id > begins:  # noqa: SLF001
                if latest is None or current._id > latest._id:  # noqa: SLF001
                    latest = current
        if latest is None:
            return None
        for earlier in self.graph.get_operations():
            if not begins < earlier._id < latest._id or not earlier._is_stateful:  # noqa: SLF001
                continue
            table = self._grouped_ancestor(earlier)
            if table is not None:
                return f"its ids come from a stateful op ({latest.name}) traced after one " \
                       f"that uses the rows of {table!r} ({earlier.name}); TensorFlow runs " \
                       f"them in that order, so these ids cannot be pulled with those rows"
        return None

    def _grouped_ancestor(self, op) -> str | None:
        """The table whose placeholder `op` depends on, if any (graph walk upwards)."""
        seen = []
        for current in self._upstream(op, skip=self._clean):
            seen.append(current)
            if current in self._placeholder_ops:
                return next(g.remote.label for g in self._grouped if g.placeholder.op is current)
        self._clean.update(seen)
        return None

    def _upstream(self, op, skip: set = frozenset()):
        """`op` and every op of the step's graph it depends on (inputs and control inputs),
        each once; the walk does not go past ops in `skip`."""
        stack, seen = [op], set()
        while stack:
            current = stack.pop()
            if current in skip or current in seen:
                continue
            seen.add(current)
            yield current
            stack.extend(t.op for t in current.inputs if t.graph is self.graph)
            stack.extend(c for c in current.control_inputs if c.graph is self.graph)

    def push(self, remote: RemoteTable, grad, learning_rate) -> None:
        """Record this step's gradient of `remote` (sent by the step's push op)."""
        ids, values, lr = remote.push_inputs(grad, learning_rate)
        earlier = self._pushes.pop(id(remote), None)
        if earlier is not None:
            # A table updated twice in one step: each update is a step of its own on the
            # servers, as on the per-table path (one summed push would apply the optimizer
            # once, with the first learning rate). The earlier update goes now, in its own
            # push op, which runs before the step's fused push (program order).
            remote.push_op(*earlier[1:])
        self._pushes[id(remote)] = (remote, ids, values, lr)

    # ---- once the step is traced ----

    def can_push(self, grad, learning_rate) -> bool:
        """Whether an update traced now can join the step's push (it is in the step's own
        graph, not in a branch such as a loss-scaling optimizer's tf.cond)."""
        tensors = [grad.values, grad.indices] if isinstance(grad, tf.IndexedSlices) else [grad]
        tensors += [learning_rate] if isinstance(learning_rate, tf.Tensor) else []
        return tf.compat.v1.get_default_graph() is self.graph and \
            all(getattr(t, "graph", self.graph) is self.graph for t in tensors)

    def finish(self, silent: Sequence[RemoteTable], training: bool) -> tf.Operation | None:
        """Add the fused pull (rewiring the placeholders) and, for a training step, the push
        of every table (`silent`: tables the step did not update, which get an empty push);
        returns the push op, if any."""
        self._fuse_pulls(self._routing if training else None)
        if training:
            for remote in silent:
                self.push(remote, remote.empty_gradient(), None)
        if not self._pushes:
            return None
        entries = list(self._pushes.values())
        push = FusedPush([e[0] for e in entries], self._routing, self.client)
        flat = [t for e in entries for t in e[1:]]
        op = tf.numpy_function(push, flat, tf.int64, stateful=True, name="parallax_push_fused")
        return op.op

    def _fuse_pulls(self, routing: StepRouting | None) -> None:
        if not self._grouped:
            return
        pull = FusedPull([g.remote for g in self._grouped], routing, self.client)
        outputs = tf.numpy_function(pull, [self.ticket] + [g.unique for g in self._grouped],
                                    [g.remote.dtype for g in self._grouped], stateful=False,
                                    name="parallax_pull_fused")
        for lookup, rows in zip(self._grouped, outputs):
            rows.set_shape([None, lookup.remote.dim])
            for consumer in list(lookup.placeholder.consumers()):
                for index, tensor in enumerate(consumer.inputs):
                    if tensor is lookup.placeholder:
                        consumer._update_input(index, rows)  # noqa: SLF001 - the rewrite


def _unfed(remote: RemoteTable):
    """The placeholder's function: never run once rewired (pruned as a stateless op with no
    consumers); if it ever ran, it would hand back no rows rather than stale ones."""
    def unfed(unique: np.ndarray, ticket: np.float64) -> np.ndarray:
        return remote.empty_rows()
    return unfed
