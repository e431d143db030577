"""The package's shape (docs/design.md 7): head-side code apart from
node-side code, no import cycle, the network kept apart from the tree core, and files short
enough to read (or saying why not at their top).

The import graph is read with ``ast`` from the source, not by importing it: every import
counts, those inside functions too; those under ``if TYPE_CHECKING:`` do not (they never run),
nor does ``edgespec/__init__``'s lazy ``Ring`` (resolved in ``__getattr__`` on first use).
"""

from __future__ import annotations

import ast
from pathlib import Path

import edgespec

SRC = Path(edgespec.__file__).resolve().parent
MAX_LINES = 450
OVER_MARK = "Over 450 lines:"

# The allowed head -> node imports: LocalChain runs node-side workers in the head's process.
HEAD_MAY_IMPORT_NODE = {"edgespec.head.chain"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_runtime(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str) -> str | None:
    """The deepest edgespec module that ``name`` names (a module, or a name in one)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(mod: str) -> set[str]:
    path = MODULES[mod]
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in _walk_runtime(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod if is_pkg else mod.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                src = f"{base}.{node.module}" if node.module else base
            else:
                src = node.module or ""
            targets = [f"{src}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            r = _resolve(t)
            if r is not None and r != mod:
                found.add(r)
    return found


def _lazy_ring_imports() -> set[str]:
    """What ``edgespec/__init__`` imports inside ``__getattr__`` (the lazy ``Ring``)."""
    tree = ast.parse(MODULES["edgespec"].read_text())
    out: set[str] = set()
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__":
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    out |= {r for a in node.names if (r := _resolve(f"{node.module}.{a.name}"))}
    return out


def import_graph() -> dict[str, set[str]]:
    graph = {m: imports_of(m) for m in MODULES}
    graph["edgespec"] -= _lazy_ring_imports()
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def _under(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def test_graph_reads_imports_inside_functions() -> None:
    """The checks below see what they claim to: lazy imports in functions count."""
    graph = import_graph()
    assert "edgespec.llm.models" in graph["edgespec.node.daemon"]  # imported in Node.__init__
    assert "edgespec.api" not in graph["edgespec"]  # the lazy Ring is left out on purpose
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_node_and_head_stay_apart() -> None:
    graph = import_graph()
    assert any(_under(m, "edgespec.node") for m in graph), "no node/ package"
    wrong = []
    for mod, deps in graph.items():
        for d in deps:
            if _under(mod, "edgespec.node") and _under(d, "edgespec.head"):
                wrong.append(f"{mod} imports {d}")
            if (_under(mod, "edgespec.head") and _under(d, "edgespec.node")
                    and mod not in HEAD_MAY_IMPORT_NODE):
                wrong.append(f"{mod} imports {d}")
    assert not wrong, "\n".join(sorted(wrong))


def test_network_and_tree_core_apart() -> None:
    """No module both talks to sockets and drives the C++ tree core (docs/design.md: the
    engine stays ignorant of sockets, the wire ignorant of trees)."""
    net = {"edgespec.wire.transport", "edgespec.wire.server"}
    both = sorted(m for m, deps in import_graph().items()
                  if deps & net and "edgespec.tree.core" in deps)
    assert not both, f"modules importing both the network and the tree core: {both}"


def test_files_short_or_say_why() -> None:
    long = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not any(
                ln.lstrip('"# ').startswith(OVER_MARK) for ln in lines[:5]):
            long.append(f"{path.relative_to(SRC.parent)}: {len(lines)} lines")
    assert not long, (f"over {MAX_LINES} lines without a line '{OVER_MARK} <why>' at the "
                      f"top: " + ", ".join(long))
