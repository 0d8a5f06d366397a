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


# ----------------------------------------------------------------------------- the package's layout (issue 54)

# troll/ holds the lesson, one concept a file; the lab sits in folders, each a layer that imports only its own
# layer and those below it (the lesson is the lowest: the math, the rollout and the policy's forward pass)
LESSON = {"advantages", "aggregate", "dual", "growth", "head", "lora", "losses", "padding", "policy", "project",
          "rollout", "sparse", "train", "weights"}  # fmt: skip
LAYERS = {"base": 1, "tasks": 2, "models": 3, "run": 4, "tools": 5, "integrations": 6}
STARTS_A_RUN = {"troll.train"}  # the lesson's one module that reaches into the lab: it starts a run


def layer(module: str) -> int:
    """0 for the lesson (troll.X, the package itself), else the layer of the folder troll.F.X is in."""
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 2 or parts[-1] in LAYERS else 0


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports (module, imported) that run from a layer to a higher one, but the run's start (STARTS_A_RUN)."""
    return sorted((m, d) for m, deps in graph.items() for d in deps if m not in STARTS_A_RUN and layer(d) > layer(m))


def test_troll_opens_on_the_lesson_and_each_folder_says_what_it_holds():
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    assert top == LESSON
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS)
    for folder in folders:
        assert ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())), folder


def test_imports_run_one_way():
    """No import from a layer into a higher one (the lesson imports only the lesson, troll.train excepted)."""
    graph = module_imports(PACKAGE)
    assert {"troll.tools.evaluate", "troll.models.build", "troll.run.harness"} <= graph.keys()
    assert upward(graph) == []


def test_an_upward_import_is_found():
    graph = {
        "troll.sparse": {"troll.base.cli"},  # the lesson into the lab
        "troll.train": {"troll.run.start"},  # the run's start: allowed
        "troll.run.start": {"troll.lora"},
        "troll.models.build": {"troll.tools.evaluate"},  # a layer into a higher one
        "troll.tools.evaluate": {"troll.models.build"},
    }
    assert upward(graph) == [("troll.models.build", "troll.tools.evaluate"), ("troll.sparse", "troll.base.cli")]


def test_the_lessons_bounds():
    """What a reader takes in at once stays that size: README within 15 KB, each study module within 460 lines,
    train.py within 320 with its `rl_step` within 40, losses.py under 400."""
    root = PACKAGE.parent
    assert (root / "README.md").stat().st_size <= 15_000
    for path in (root / "study").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 460, path.name
    train = (PACKAGE / "train.py").read_text()
    assert len(train.splitlines()) <= 320
    step = next(n for n in ast.walk(ast.parse(train)) if isinstance(n, ast.FunctionDef) and n.name == "rl_step")
    assert step.end_lineno - step.lineno + 1 <= 40
    assert len((PACKAGE / "losses.py").read_text().splitlines()) < 400
