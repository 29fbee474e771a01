"""The package's layering and import graph, read from the source with ``ast``.

Bottom up (docs/architecture.md): ``kvtypes`` -> ``wire`` -> ``pipeline`` and ``kernels``
-> ``broker``, ``workers`` -> ``http`` -> ``commands``/``cli``. A module may import from
its own layer and the layers below, never from above; a few pairs inside or across
layers are forbidden on top of that. Every import counts: at module level, inside a
function, under a condition. And no two modules may import each other, directly or
round a longer loop (function-level imports included: a cycle hidden in a function
still ties the two modules together).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tandem"

# Bottom up. An entry names a module or a package (and everything under it); the root
# package ``tandem`` stands for its __init__ alone, so a new top-level module must be
# placed here before the test passes.
LAYERS: list[tuple[str, ...]] = [
    # value types, the environment-knob registry, and the process set-up that runs
    # before anything imports mlx
    ("tandem.kvtypes", "tandem.knobs", "tandem", "tandem._blas", "tandem._malloc", "tandem._mlx_cuda",
     "tandem._parent_death"),
    ("tandem.wire",),
    ("tandem.pipeline", "tandem.kernels"),
    ("tandem.broker", "tandem.workers"),
    # config gathers every package's settings; the edge app reads it
    ("tandem.http", "tandem.config"),
    ("tandem.commands", "tandem.cli", "tandem.sdnotify", "tandem.supervisor"),
]

# (importer, imported): forbidden even where the layers allow it.
FORBIDDEN: list[tuple[str, str, str]] = [
    ("tandem.workers", "tandem.broker", "workers and broker share only the protocol (wire)"),
    ("tandem.broker", "tandem.workers", "workers and broker share only the protocol (wire)"),
    ("tandem.broker", "tandem.pipeline", "the broker is model-free: shared types live in kvtypes"),
    ("tandem.broker", "tandem.kernels", "the broker is model-free"),
    ("tandem.kernels", "tandem.pipeline", "kernels are compute the engine's runners call, not the reverse"),
]

def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) for every module under tandem/."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """importer -> {imported module: first line}. ``from a.b import c`` counts as an
    import of ``a.b.c`` where that is a module, else of ``a.b``; a name that is not a
    module of the package is resolved to its nearest enclosing module."""
    mods = modules()

    def nearest(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [nearest(a.name) for a in node.names if a.name.split(".")[0] == "tandem"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "tandem":
                    continue
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else nearest(source) for a in node.names]
            elif isinstance(node, ast.Call) and _called(node.func) == "import_module" and node.args:
                targets = [m for m in mods if _dynamic_match(node.args[0], m)]
            for target in targets:
                if target is not None and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def _called(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _dynamic_match(arg: ast.expr, module: str) -> bool:
    """Whether ``importlib.import_module(arg)`` may import ``module``: a constant names it;
    an f-string counts as every module under its constant prefix."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value == module
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = str(arg.values[0].value)
        return prefix.startswith("tandem") and module.startswith(prefix) and module != prefix.rstrip(".")
    return False


def _owner(module: str, entries) -> str | None:
    """The longest entry that is ``module`` or a package holding it."""
    hits = [e for e in entries if module == e or (e != "tandem" and module.startswith(e + "."))]
    return max(hits, key=len) if hits else None


def layer_of(module: str) -> int:
    entries = {e: i for i, layer in enumerate(LAYERS) for e in layer}
    owner = _owner(module, entries)
    if owner is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}")
    return entries[owner]


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module (iterative: the graph is a few hundred nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def a_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """The shortest loop from ``component``'s first module back to it (breadth first)."""
    members, start = set(component), component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph.get(node, ())):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start] + path[::-1][1:] + [start]
                if target in members and target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{component} is not a cycle")


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_graph_sees_imports_at_every_level(graph):
    # module level, inside a function, and a relative-free ``from package import module``
    assert "tandem.wire.codec" in graph["tandem.wire.client"]
    assert "tandem.wire.secret" in graph["tandem.cli"]  # imported inside main()
    assert "tandem.config" in graph["tandem.commands.worker"]  # ``from tandem import config``
    assert "tandem.commands.serve" in graph["tandem.cli"]  # importlib.import_module(f"tandem.commands.{name}")


def test_every_module_has_a_layer(graph):
    for module in graph:
        layer_of(module)  # raises, naming the module, for one in no layer


def test_nothing_imports_from_a_layer_above_it(graph):
    wrong = []
    for importer, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            if layer_of(target) > layer_of(importer):
                wrong.append(f"{importer} (layer {layer_of(importer)}) imports {target} (layer {layer_of(target)}) "
                             f"at line {line}")
    assert not wrong, "imports upward:\n" + "\n".join(wrong)


def test_no_forbidden_pair(graph):
    wrong = []
    for importer, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            for src, dst, why in FORBIDDEN:
                if _owner(importer, [src]) and _owner(target, [dst]):
                    wrong.append(f"{importer} imports {target} at line {line}: {why}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles(graph):
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(a_cycle(graph, c)) for c in cycles)


def test_the_cycle_finder_finds_a_loop():
    g = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}, "e": {"e": 1}}
    assert strongly_connected(g) == [["a", "b", "c"]]
    assert a_cycle(g, ["a", "b", "c"]) == ["a", "b", "c", "a"]
