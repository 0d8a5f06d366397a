"""The import graph of troll/ has no cycle: every import counts, those under `if TYPE_CHECKING:` (a type hint that
needs the other module is a dependency too) and those inside a function body (they run when it is called: an
optional extra, a lazily built piece) included."""

import ast
from pathlib import Path

import troll

PACKAGE = Path(troll.__file__).parent


def module_imports(package: Path) -> dict[str, set[str]]:
    """{module: the package's modules it imports anywhere in its file} for every .py file under `package`."""
    names = {}
    for path in package.rglob("*.py"):
        parts = (package.name, *path.relative_to(package).with_suffix("").parts)
        names[".".join(parts).removesuffix(".__init__")] = path
    graph = {}
    for name, path in names.items():
        found: set[str] = set()
        stack: list[ast.AST] = [ast.parse(path.read_text())]
        while stack:
            node = stack.pop()
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}  # `from troll import lora`
            stack.extend(ast.iter_child_nodes(node))
        graph[name] = {m for m in found if m in names and m not in (name, package.name)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) per back edge of a depth-first search."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    out: list[list[str]] = []

    def visit(u: str) -> None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                out.append(path[path.index(v) :] + [v])
            elif v not in state:
                visit(v)
        path.pop()
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u)
    return out


def test_the_walker_finds_a_type_checking_cycle_and_function_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "c.py").write_text("from pkg import a\n")
    (pkg / "d.py").write_text("def g():\n    from pkg import c\n")
    graph = module_imports(pkg)
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}, "pkg.d": {"pkg.c"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_troll_has_no_import_cycle():
    graph = module_imports(PACKAGE)
    assert {"troll.policy", "troll.rollout", "troll.train"} <= graph.keys()
    assert "troll.padding" in graph["troll.rollout"]  # the walker sees troll's imports
    assert cycles(graph) == []
