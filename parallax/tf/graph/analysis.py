"""Classify how each variable is read in a traced TensorFlow graph.

A variable can live on the parameter servers, and be pulled row by row, only when every read of
it in the training step is a row gather on axis 0; any other read needs the whole table on the
worker, so such a variable stays dense and is all-reduced. `inspect_reads` walks from each
variable's captured resource handle through reads, value-preserving ops (Identity, Cast, ...) and
nested functions (tf.function calls, tf.cond, tf.while_loop, switch_case), and says which it is,
with a reason a user can act on.

Relies on TensorFlow internals (checked on TF 2.17): `FuncGraph.captures` as (external, internal)
pairs, `Graph._get_function(name)` returning an object whose `.graph` is the body FuncGraph, and
`function_def_to_graph` as a fallback for bodies only known as a FunctionDef.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import tensorflow as tf

_UPDATES = frozenset({
    "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "VarIsInitializedOp",
    "VariableShape", "DestroyResourceOp", "ResourceStridedSliceAssign",
})
_UPDATE_PREFIXES = ("ResourceScatter", "ResourceApply", "ResourceSparseApply")
_PASS_THROUGH = frozenset({
    "Identity", "IdentityN", "Cast", "Snapshot", "StopGradient", "PreventGradient", "EnsureShape",
    "CheckNumerics", "CheckNumericsV2",
})
_METADATA = frozenset({"Shape", "ShapeN", "Size", "Rank"})
_MATMULS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})
_CALLS = frozenset({"StatefulPartitionedCall", "PartitionedCall"})
_IFS = frozenset({"If", "StatelessIf"})
_CASES = frozenset({"Case", "StatelessCase"})
_WHILES = frozenset({"While", "StatelessWhile"})
NOT_READ = "not read in the traced step"


@dataclass(frozen=True)
class ReadReport:
    """How one variable is read: whether it can be served row by row, and why."""

    gather_only: bool
    reason: str
    gather_reads: int
    dense_reads: tuple[str, ...]


def inspect_reads(graph, variables) -> dict[int, ReadReport]:
    """Classify every variable's reads in `graph` (e.g. `concrete_function.graph`).

    `variables` are tf.Variables or Keras 3 variables (whose tf.Variable is `.value`); the result
    is keyed by `id()` of each object passed in.
    """
    captured = _captured_handles(graph)
    walker = _Walker()
    reports = {}
    for variable in variables:
        handle = _handle(variable)
        handles = captured.get(id(handle), [])
        if not handles and getattr(handle, "op", None) is not None and handle.graph is graph:
            handles = [handle]  # a variable created inside the graph itself
        findings = _Findings()
        for handle in handles:
            walker.walk(handle, is_handle=True, scope=_Scope.top(graph), path=(), out=findings)
        reports[id(variable)] = findings.report()
    return reports


def _handle(variable):
    """The resource handle of a tf.Variable, or of the tf.Variable inside a Keras 3 variable."""
    value = getattr(variable, "value", None)
    if value is not None and not callable(value):  # tf.Variable.value is a method
        variable = value
    return getattr(variable, "handle", None)


def _captured_handles(graph) -> dict[int, list]:
    """id(external tensor) -> the placeholders standing for it inside `graph`."""
    result = collections.defaultdict(list)
    for external, internal in getattr(graph, "captures", ()):
        result[id(external)].append(internal)
    return result


@dataclass
class _Findings:
    """What a walk found for one variable (mutable while walking)."""

    gathers: collections.Counter = field(default_factory=collections.Counter)
    dense: list = field(default_factory=list)
    uninspectable: list = field(default_factory=list)  # reasons naming an opaque consumer

    def report(self) -> ReadReport:
        count = sum(self.gathers.values())
        if self.dense:
            return ReadReport(False, self._dense_reason(count), count, tuple(self.dense))
        if not count:
            return ReadReport(False, NOT_READ, 0, ())
        chains = ", ".join(f"{chain} x{n}" for chain, n in sorted(self.gathers.items()))
        return ReadReport(True, f"every read is a row gather on axis 0 ({chains})", count, ())

    def _dense_reason(self, gathers: int) -> str:
        if self.uninspectable:
            reason = self.uninspectable[0]
        else:
            first = self.dense[0]
            reason = ("also read by " if gathers else "read densely by ") + first
            if gathers and first.split(" ", 1)[0] in _MATMULS:
                reason += ": dense use such as tied softmax weights?"
        more = len(self.dense) - 1
        return reason + (f" (and {more} more dense read{'s' * (more > 1)})" if more else "")

    def cannot_inspect(self, op, where: str) -> None:
        """Record an op parallax cannot see into: it may read the variable in any way."""
        self.dense.append(f"{op.type} '{op.name}'{where}")
        self.uninspectable.append(
            f"passed into {op.type} '{op.name}'{where}, which parallax cannot inspect")


@dataclass
class _Scope:
    """One function body being walked: its outputs, where it sits, which outputs were reached."""

    outputs: dict
    where: str
    libraries: tuple
    is_top: bool = False
    reached: set = field(default_factory=set)
    seen: set = field(default_factory=set)

    @classmethod
    def top(cls, graph) -> "_Scope":
        return cls(_output_indices(graph), "", (graph,), is_top=True)

    @classmethod
    def body(cls, graph, call, parent: "_Scope") -> "_Scope":
        where = f" in {call.type} '{call.name}'{parent.where}"
        return cls(_output_indices(graph), where, (graph, *parent.libraries))


def _output_indices(graph) -> dict:
    """Tensor name -> its positions among the graph's outputs."""
    outputs = collections.defaultdict(list)
    for index, tensor in enumerate(getattr(graph, "outputs", ())):
        outputs[tensor.name].append(index)
    return outputs


class _Walker:
    """Follows a handle or a read value to the ops that consume it."""

    def __init__(self) -> None:
        self._bodies: dict[str, object] = {}

    def walk(self, tensor, is_handle: bool, scope: _Scope, path: tuple, out: _Findings) -> None:
        """Classify every use of `tensor` (a resource handle or a read value) in `scope`."""
        if (tensor.name, is_handle) in scope.seen:
            return
        scope.seen.add((tensor.name, is_handle))
        if tensor.name in scope.outputs and scope.is_top and not is_handle:
            out.dense.append(f"Return '{tensor.name}' (the traced step returns the whole value)")
        scope.reached.update(scope.outputs.get(tensor.name, ()))
        for op in {op.name: op for op in tensor.consumers()}.values():
            for index, consumed in enumerate(op.inputs):
                if consumed.name == tensor.name:
                    self._use(op, index, is_handle, scope, path, out)

    def _use(self, op, index, is_handle, scope, path, out) -> None:
        """Classify one use: input `index` of `op`."""
        kind = op.type
        if kind in _PASS_THROUGH:
            output = op.outputs[index if kind == "IdentityN" else 0]
            self.walk(output, is_handle, scope, path + (kind,), out)
        elif _is_function_op(op, scope):
            self._call(op, index, is_handle, scope, path, out)
        elif is_handle:
            self._handle_use(op, index, scope, path, out)
        elif kind in _METADATA:
            return
        elif _is_row_gather(op, index):
            out.gathers["->".join(path + (kind,))] += 1
        else:
            out.dense.append(f"{kind} '{op.name}'{scope.where}")

    def _handle_use(self, op, index, scope, path, out) -> None:
        """Classify a use of the resource handle itself."""
        kind = op.type
        if kind in _UPDATES or kind.startswith(_UPDATE_PREFIXES):
            return
        if kind == "ReadVariableOp":
            self.walk(op.outputs[0], False, scope, path + (kind,), out)
        elif kind == "ResourceGather" and _attr(op, "batch_dims", 0) == 0:
            out.gathers["->".join(path + (kind,))] += 1
        elif kind in ("ResourceGather", "ResourceGatherNd"):
            out.dense.append(f"{kind} '{op.name}'{scope.where}")
        else:
            out.cannot_inspect(op, scope.where)

    def _call(self, op, index, is_handle, scope, path, out) -> None:
        """Follow an input of a function-calling op into its body (or bodies) and back out."""
        if index == 0 and (op.type in _IFS or op.type in _CASES):  # used as predicate / index
            out.dense.append(f"{op.type} '{op.name}'{scope.where}")
            return
        targets = self._targets(op, index, scope)
        if targets is None:
            out.cannot_inspect(op, scope.where)
            return
        reached = set()
        for body, arg, feeds_outputs in targets:
            inner = _Scope.body(body, op, scope)
            self.walk(body.inputs[arg], is_handle, inner, path + (op.type,), out)
            if feeds_outputs:
                reached |= inner.reached
        for k in sorted(reached):
            self.walk(op.outputs[k], is_handle, scope, path, out)

    def _targets(self, op, index, scope):
        """(body graph, argument index, body outputs are op outputs) for input `index`, or None."""
        kind = op.type
        if kind in _IFS or kind in _CASES:
            names = ([op.get_attr("then_branch").name, op.get_attr("else_branch").name]
                     if kind in _IFS else [f.name for f in op.get_attr("branches")])
            specs = [(name, index - 1, True) for name in names]
        elif kind in _WHILES:
            specs = [(op.get_attr("cond").name, index, False),
                     (op.get_attr("body").name, index, True)]
        elif kind in _CALLS:
            specs = [(op.get_attr("f").name, index, True)]
        else:  # a direct call of a library function, whose op type is the function's name
            specs = [(kind, index, True)]
        targets = []
        for name, arg, feeds_outputs in specs:
            body = self._body(name, scope)
            if body is None or arg >= len(body.inputs):
                return None
            targets.append((body, arg, feeds_outputs))
        return targets

    def _body(self, name: str, scope: _Scope):
        """The graph of library function `name`, looked up from the innermost scope outwards."""
        if name not in self._bodies:
            self._bodies[name] = None
            for library in scope.libraries:
                function = library._get_function(name)  # noqa: SLF001 - TF 2.17's, no public one
                if function is not None:
                    self._bodies[name] = _function_graph(function)
                    break
        return self._bodies[name]


def _function_graph(function):
    """A FuncGraph for a library function (AtomicFunction.graph, else its FunctionDef)."""
    graph = getattr(function, "graph", None)
    if graph is not None:
        return graph
    definition = getattr(function, "definition", None)
    if definition is None:
        return None
    from tensorflow.python.framework.function_def_to_graph import function_def_to_graph

    return function_def_to_graph(definition)


def _is_function_op(op, scope: _Scope) -> bool:
    """Whether `op` runs a function body parallax may look into."""
    kind = op.type
    if kind in _CALLS or kind in _IFS or kind in _CASES or kind in _WHILES:
        return True
    return any(library._is_function(kind)  # noqa: SLF001 - TF's, as above
               for library in scope.libraries)


def _is_row_gather(op, index: int) -> bool:
    """Whether `op` gathers whole rows (axis 0, no batch dims) of its input `index`."""
    if index != 0:
        return False
    if op.type == "Gather":
        return True
    if op.type != "GatherV2" or _attr(op, "batch_dims", 0) != 0:
        return False
    axis = tf.get_static_value(op.inputs[2])
    if axis is None or getattr(axis, "ndim", 0) != 0:
        return False
    rank = op.inputs[0].shape.rank
    return int(axis) == 0 or (rank is not None and int(axis) == -rank)


def _attr(op, name: str, default):
    """An op attribute, or `default` when the op has none by that name."""
    try:
        return op.get_attr(name)
    except ValueError:
        return default
