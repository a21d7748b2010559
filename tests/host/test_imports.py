"""The package's modules import one another without a cycle, and stay short enough to read in one sitting.

The import graph is read statically (``ast``) from every module under ``tpcomm/``: its nodes are the
modules (a package is its ``__init__``), its edges every import statement that names a module of the
package, at module level or inside a function or method (an import deferred into a function still
ties the two modules together: ``graphs.warmup`` importing ``ops`` while ``ops`` imports ``graphs`` is a
cycle, even though Python resolves it at run time). Counted: ``import tpcomm.x``, ``from tpcomm.x import
y``, ``from . import x``, ``from .x import y`` and ``from .. import x`` (an edge to submodule ``x`` where
``x`` is one, else to the package that holds the name). Not counted: the implicit import of a parent
package that Python performs before a submodule (every module would otherwise depend on
``tpcomm/__init__.py``).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tpcomm"
#: Longest module, in lines (``wc -l``): a file read in one sitting.
MAX_LINES = 600


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (path, is_package)}`` of every module under ``tpcomm/``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _imported(name: str, path: Path, is_package: bool, modules: dict) -> set[str]:
    """The package's modules that the module ``name`` imports anywhere in its code."""
    package = name if is_package else name.rsplit(".", 1)[0]
    named = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            named += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    edges = set()
    for target in named:
        while target and target not in modules:  # tpcomm.x.y (a name in module tpcomm.x) -> tpcomm.x
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, is_package, modules) for name, (path, is_package) in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_sees_the_imports_it_should():
    """The walker finds module-level, relative, parent-relative and deferred imports (else a cycle could
    hide from the test below)."""
    graph = import_graph()
    assert "tpcomm.collectives.fused_norm" in graph["tpcomm.communicator"]  # from .collectives import ...
    assert "tpcomm.validate" in graph["tpcomm.quant.forms"]  # from ..validate import ...
    assert "tpcomm.ops" in graph["tpcomm.graphs"]  # deferred: inside warmup()
    assert "tpcomm.communicator" in graph["tpcomm.ops.registry"]  # deferred: inside register()
    assert "tpcomm.ops.registry" in graph["tpcomm.ops.moe"]  # from .registry import ...


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_modules_are_short(name):
    path = _modules()[name][0]
    lines = path.read_text().count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines (at most {MAX_LINES})"


@pytest.mark.parametrize("op", ["all_reduce", "fused_add_rmsnorm", "all_gather", "reduce_scatter", "fused_qk_rmsnorm",
                                "fused_moe_finalize_add_rmsnorm"])
def test_each_communicator_op_hands_over_to_its_module(op):
    """An op's host path lives in its module (``tpcomm/collectives/``); the method looks the call up in
    the call cache and hands it over, in under 40 lines with its docstring."""
    import inspect

    from tpcomm import Communicator

    lines = len(inspect.getsourcelines(getattr(Communicator, op))[0])
    assert lines < 40, f"Communicator.{op} has {lines} lines"
