"""The tree's architecture, checked from the source (fast tier: no TensorFlow, no processes).

Each package of `parallax/` is one layer and imports only the layers it may (`ALLOWED`);
the server imports the shared protocol and nothing of the client or the TensorFlow side;
only `parallax/tf/` and the Keras layers (`parallax/layers/`, and the benchmark's training
processes) import TensorFlow; and no
module imports, even inside a function, a module that imports it back. Importing a module
counts as importing each package above it too (their `__init__` runs). Imports under
`if TYPE_CHECKING:` are for type checkers only and do not count.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# layer -> the layers it may import (besides itself)
ALLOWED = {
    "errors": set(),
    "version": set(),
    "env": {"errors"},
    "native": {"env", "errors"},  # the compiled data path's loader (parallax.native)
    "protocol": {"env", "errors", "native", "ps", "version"},
    "runtime": {"env", "errors"},
    "client": {"env", "errors", "native", "protocol", "ps", "runtime", "version"},
    "placement": {"env", "errors", "protocol"},
    "tf": {"client", "env", "errors", "native", "placement", "protocol", "ps", "runtime",
           "version"},
    "launch": {"client", "env", "errors", "protocol", "ps", "runtime", "version"},
    "layers": {"errors", "placement", "protocol", "tf"},  # Keras layers users build models of
    # the package's own __init__, which every import of parallax.* from outside runs: only
    # the low layers at import time (the client and the strategy are loaded when named)
    "parallax": {"errors", "protocol", "runtime", "version"},
    "bench": {"client", "env", "errors", "launch", "native", "parallax", "placement",
              "protocol", "ps", "runtime", "tf", "version"},
    "servers": {"env", "errors", "native", "parallax", "protocol", "ps", "runtime",
                "version"},
    "cli": {"bench", "client", "env", "errors", "launch", "native", "protocol", "runtime",
            "servers", "version"},
    "__main__": {"cli"},  # `python -m parallax`: the command, nothing else
}
TENSORFLOW = ("tensorflow", "keras", "horovod.tensorflow", "horovod.keras", "tf_keras")
TF_OUTSIDE_TF = {"parallax.bench.worker", "parallax.bench.tf_peers", "parallax.bench.models"}
# parallax/tf/'s rooms (its subpackages and top modules) -> the rooms each may import
TF_ROOMS = {
    "graph": set(),  # the traced step's variable, ops, fusion and read analysis
    "collectives": set(),  # `Workers` and its backends (`BACKENDS`)
    "keras_support": set(),  # what parallax reads of Keras
    "state": {"collectives", "graph"},  # resume, resharding, the tuner
    "keras_patches": {"graph", "keras_support", "state"},  # every change parallax makes to Keras
    "strategy": {"collectives", "graph", "keras_patches", "keras_support", "state"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for base, top in ((ROOT, "parallax"), (ROOT / "servers", "parallax_ps")):
        for path in sorted((base / top).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[:3] == ("parallax", "ps", "v1"):
                continue  # generated
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imported(tree: ast.AST) -> list[str]:
    """Every absolute module name imported anywhere in `tree` (functions included), but not
    under `if TYPE_CHECKING:`."""
    names = []
    for node in ast.iter_child_nodes(tree):
        if _type_checking(node):
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        names += _imported(node)
    return names


def test_no_module_imports_relatively():
    """The rules above read absolute imports; a relative one (`from ..strategy import x`)
    would escape them, so there are none."""
    relative = [f"{name}:{node.lineno}" for name, path in MODULES.items()
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert not relative, f"relative imports (write them absolute): {relative}"


HOT_PATH = ("parallax.client", "parallax.tf")  # the worker's step: its numpy side and its ops


def _module_names(tree: ast.AST) -> dict[str, str]:
    """{name bound by an import in `tree`: the project module it is}."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.partition(".")[0]] = alias.name
    return bound


def _private_reaches(name: str, path: Path) -> list[str]:
    """`x._field` in module `name` where x is not self, cls, super() or a module of the
    module's own layer, on a line that does not say why (`# noqa: SLF001 - ...`)."""
    source = path.read_text()
    lines, tree = source.splitlines(), ast.parse(source)
    layer = ".".join(name.split(".")[:2])
    modules = _module_names(tree)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or
                                            modules.get(owner.id, "").startswith(layer + ".")):
            continue
        if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
            continue
        if "noqa: SLF001" not in lines[node.lineno - 1]:
            found.append(f"{name}:{node.lineno} .{node.attr}")
    return found


def test_the_hot_path_reaches_no_private_field_across_packages():
    """The worker's step (parallax/client, parallax/tf) uses another object's private
    field (`x._name`) only on itself, on a module of its own layer, or where the line says
    why (`# noqa: SLF001 - ...`: TensorFlow's or Keras' internals, which have no public
    form). A private field of another parallax package is reached through its public API."""
    reaches = [r for name, path in MODULES.items() if name.startswith(HOT_PATH)
               for r in _private_reaches(name, path)]
    assert not reaches, f"private fields reached across packages: {reaches}"


def _own(name: str) -> str | None:
    """The project module `name` is, or is in; None for a third-party one."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _loaded(module: str, name: str) -> set[str]:
    """What importing `name` from `module` runs: the module it names and each package above
    it (their `__init__`), except `module`'s own packages, which are loaded already."""
    own = _own(name)
    if own is None:
        return set()
    parts = own.split(".")
    mine = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    return {p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
            if p in MODULES and p not in mine and p != module}


IMPORTS = {m: _imported(ast.parse(p.read_text(), str(p))) for m, p in MODULES.items()}
GRAPH = {m: set().union(*(_loaded(m, n) for n in names)) for m, names in IMPORTS.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "parallax_ps":
        return "servers"
    return parts[1] if len(parts) > 1 else "parallax"


def test_each_layer_imports_only_what_it_may():
    wrong = sorted(f"{m} ({_layer(m)}) imports {d} ({_layer(d)})"
                   for m, deps in GRAPH.items() for d in deps
                   if _layer(d) != _layer(m) and _layer(d) not in ALLOWED[_layer(m)])
    assert not wrong, "\n".join(wrong)


def test_every_module_has_a_layer():
    assert {_layer(m) for m in MODULES} <= set(ALLOWED) | {"ps"}


def test_only_the_tensorflow_side_imports_tensorflow():
    wrong = sorted(f"{m} imports {n}" for m, names in IMPORTS.items()
                   if _layer(m) not in ("tf", "layers") and m not in TF_OUTSIDE_TF
                   for n in names if any(n == t or n.startswith(t + ".") for t in TENSORFLOW))
    assert not wrong, "\n".join(wrong)


def _room(module: str) -> str | None:
    """The room of parallax/tf/ `module` is in; None outside it (and for its `__init__`)."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["parallax", "tf"] and len(parts) > 2 else None


def test_the_tensorflow_side_s_rooms_import_only_what_they_may():
    rooms = {_room(m) for m in MODULES} - {None}
    assert rooms == set(TF_ROOMS), "a room of parallax/tf/ without a rule in TF_ROOMS"
    wrong = sorted(f"{m} ({_room(m)}) imports {d} ({_room(d)})"
                   for m, deps in GRAPH.items() if _room(m) for d in deps
                   if _room(d) and _room(d) != _room(m) and _room(d) not in TF_ROOMS[_room(m)])
    assert not wrong, "\n".join(wrong)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(GRAPH[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(GRAPH[nxt]))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    assert not _cycles(), _cycles()


@pytest.mark.parametrize("source, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_cycle_finder_finds_cycles(monkeypatch, source, expected):
    monkeypatch.setattr(sys.modules[__name__], "GRAPH", source)
    assert _cycles() == expected


def test_the_wheel_lists_every_package():
    """setup.cfg names its packages one by one: a new package left out of it is missing
    from the wheel (an editable install would not notice)."""
    import configparser
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    listed = {p.strip() for p in config["options"]["packages"].split("\n") if p.strip()}
    packages = {".".join(p.parent.relative_to(ROOT).parts)
                for p in (ROOT / "parallax").rglob("__init__.py")}
    assert packages <= listed, sorted(packages - listed)


def test_the_layout_table_names_every_module():
    """docs/architecture.md's layout table (the README's pointer to where things are) names
    every module of parallax/ and of the server by its file name, so a new module is placed
    in it when it is added; the generated protobuf code is named by its folder."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = "\n".join(line for line in doc.splitlines() if line.startswith("| `"))
    modules = [*(ROOT / "parallax").rglob("*.py"), *(ROOT / "servers").rglob("*.py")]
    missing = sorted(str(p.relative_to(ROOT)) for p in modules
                     if p.name not in ("__init__.py", "__main__.py") and
                     "ps/v1" not in p.as_posix() and f"`{p.name}`" not in table and
                     f"/{p.name}`" not in table)
    assert "`parallax/ps/v1/`" in table
    assert not missing, f"not named in docs/architecture.md's layout table: {missing}"


def test_every_test_module_has_its_own_name():
    """pytest imports the tiers' test modules by their file names (no packages): two of one
    name in different tiers stop `make test`'s collection ("import file mismatch"), which a
    tier run alone never shows."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, f"test modules sharing a name: {twice}"
