"""specdec's packages import each other without cycles.

The graph is built from the source (AST; nothing is imported): one node per package under
``specdec`` (``specdec.spec``, ``specdec.engine``, ...; a top-level module such as
``specdec/config.py`` is its own node; train/, data_gen/ and serve/ install as
``specdec.train``, ``specdec.data_gen``, ``specdec.serve``). Imports inside functions count:
a lazy import hides a cycle from the interpreter, not from the design. Imports under
``if TYPE_CHECKING:`` do not count; they never run.
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Where each installed package's source lives (pyproject.toml's package-dir).
PACKAGE_DIRS = {
    "specdec": REPO / "specdec",
    "specdec.train": REPO / "train",
    "specdec.data_gen": REPO / "data_gen",
    "specdec.serve": REPO / "serve",
}

# Dependencies the layering forbids outright, cycle or not: speculation plugs into the
# engine (the engine imports spec, never the reverse), and kernels are what attention
# backends are built from.
FORBIDDEN = [
    ("specdec.spec", "specdec.engine"),
    ("specdec.kernels", "specdec.attention"),
]


@dataclass(frozen=True)
class Site:
    path: Path
    line: int
    target: str  # the imported module, e.g. "specdec.engine.scheduler"

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def _home(path: Path) -> str:
    """The installed package whose folder holds ``path`` (the innermost: specdec/ holds no
    other package's folder, but the rule does not depend on that)."""
    return max(
        (pkg for pkg, d in PACKAGE_DIRS.items() if path.is_relative_to(d)),
        key=lambda pkg: len(PACKAGE_DIRS[pkg].parts),
    )


def _module_name(path: Path) -> str:
    pkg = _home(path)
    parts = [*pkg.split("."), *path.relative_to(PACKAGE_DIRS[pkg]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source_files() -> list[Path]:
    return [
        path
        for pkg, base in PACKAGE_DIRS.items()
        for path in sorted(base.rglob("*.py"))
        if _home(path) == pkg
    ]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool):
    """(line, imported module) for every import that can run, at any depth."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # Relative: strip `level` components (one fewer from a package's __init__).
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, node.module] if node.module else anchor)
            else:
                base = node.module or ""
            # `from pkg import name` may name a submodule: count both spellings; the
            # node is the same unless `pkg` is specdec itself.
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        stack.extend(ast.iter_child_nodes(node))


def _node(module: str) -> str:
    """The graph node of a specdec module: its first component under specdec."""
    parts = module.split(".")
    return "specdec" if len(parts) == 1 else f"specdec.{parts[1]}"


def import_graph() -> dict[str, dict[str, list[Site]]]:
    """Package -> imported package -> the import statements making that edge."""
    modules = {_module_name(p): p for p in _source_files()}
    known = {_node(m) for m in modules}
    graph: dict[str, dict[str, list[Site]]] = {n: {} for n in known}
    for module, path in modules.items():
        src = _node(module)
        is_package = path.name == "__init__.py"
        seen = set()
        for line, target in _imports(ast.parse(path.read_text(), str(path)), module, is_package):
            if target.split(".")[0] != "specdec":
                continue
            dst = _node(target)
            # `from specdec import name`: a node when `name` is a subpackage or top-level
            # module, else an attribute of the root (specdec.X names no known node).
            if dst == src or dst not in known:
                continue
            if (dst, line) not in seen:
                seen.add((dst, line))
                graph[src].setdefault(dst, []).append(Site(path, line, target))
    for edges in graph.values():
        for sites in edges.values():
            sites.sort(key=lambda s: (str(s.path), s.line))
    return graph


def _shortest_path(graph, start: str, goal: str) -> list[str] | None:
    prev: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = [node]
            while prev[path[-1]] is not None:
                path.append(prev[path[-1]])
            return path[::-1]
        for nxt in sorted(graph[node]):
            if nxt not in prev:
                prev[nxt] = node
                queue.append(nxt)
    return None


def find_cycles(graph) -> list[list[str]]:
    """One shortest cycle through every edge that lies on a cycle, deduplicated."""
    cycles = {}
    for src in sorted(graph):
        for dst in sorted(graph[src]):
            back = _shortest_path(graph, dst, src)
            if back is None:
                continue
            cycle = [src, *back]  # src -> dst -> ... -> src
            ring = cycle[:-1]
            i = ring.index(min(ring))
            key = tuple(ring[i:] + ring[:i])
            cycles.setdefault(key, [*key, key[0]])
    return sorted(cycles.values(), key=lambda c: (len(c), c))


def describe(graph, cycle: list[str]) -> str:
    text = cycle[0]
    for src, dst in itertools.pairwise(cycle):
        sites = graph[src][dst]
        more = f" +{len(sites) - 1} more" if len(sites) > 1 else ""
        text += f" -> {dst} ({sites[0]}{more})"
    return text


def test_no_import_cycles_between_packages():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles between specdec's packages:\n" + "\n".join(
        describe(graph, c) for c in cycles
    )


def test_layering():
    graph = import_graph()
    broken = [
        f"{src} imports {dst}: " + ", ".join(f"{s} ({s.target})" for s in graph[src][dst])
        for src, dst in FORBIDDEN
        if dst in graph[src]
    ]
    assert not broken, "\n".join(broken)


def test_the_checker_sees_a_lazy_import_cycle(tmp_path, monkeypatch):
    """A cycle made by an import inside a function is found and spelled out; one under
    ``if TYPE_CHECKING:`` is not an edge."""
    pkg = tmp_path / "specdec"
    for name, text in {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/x.py": "from specdec.b import y\n",
        "b/__init__.py": "",
        "b/y.py": "def f():\n    from specdec.a.x import g\n",
        "c/__init__.py": "",
        "c/z.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import specdec.a\n",
        "a/w.py": "from ..c import z\n",
    }.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    monkeypatch.setitem(globals(), "PACKAGE_DIRS", {"specdec": pkg})
    graph = import_graph()
    assert set(graph["specdec.a"]) == {"specdec.b", "specdec.c"}
    assert graph["specdec.c"] == {}
    cycles = find_cycles(graph)
    assert [describe(graph, c) for c in cycles] == [
        "specdec.a -> specdec.b (specdec/a/x.py:1) -> specdec.a (specdec/b/y.py:2)"
    ]
