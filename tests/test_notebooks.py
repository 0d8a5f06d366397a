"""The notebooks in notebooks/ are committed with their outputs, and they run top to bottom with their final assertions
holding.

scripts/run_notebooks.py executes them and writes the outputs back (`python scripts/run_notebooks.py`); the tests here
run its `execute` on the `python3` kernel, which must be this interpreter (ipykernel ships that kernelspec inside the
virtualenv; nothing is registered globally), in a fresh temporary working directory, without writing back.
"""

from __future__ import annotations

import copy
import runpy
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = runpy.run_path(str(ROOT / "scripts" / "run_notebooks.py"))
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = [
    "01_clipping_vs_trust_regions.ipynb",
    "02_sparse_supports.ipynb",
    "03_the_dual.ipynb",
    "04_implicit_gradient.ipynb",
    "05_the_objective.ipynb",
    "06_end_to_end.ipynb",
    "07_rare_tokens.ipynb",
    "08_token_by_token.ipynb",
]
DRAWS = ("plt.show()", "display(Image(")  # a cell that draws a figure with either carries an image/png output


def test_all_notebooks_are_collected():
    """The parametrisation below can never be silently empty or miss a notebook."""
    assert [p.name for p in NOTEBOOKS] == EXPECTED
    assert SCRIPT["NOTEBOOK_DIR"] == NOTEBOOK_DIR


def test_kernel_is_this_interpreter():
    """The `python3` kernelspec launches the interpreter running the tests (the virtualenv's python)."""
    kernel = SCRIPT["KERNEL"]
    cmd = KernelManager(kernel_name=kernel).format_kernel_cmd()
    assert Path(cmd[0]).resolve() == Path(sys.executable).resolve(), (
        f"kernel {kernel!r} runs {cmd[0]}, not {sys.executable}: is ipykernel installed in this environment?"
    )


def committed_problems(nb: nbformat.NotebookNode) -> list[str]:
    """What is wrong with `nb` as a committed notebook: every code cell ran, once, in order, without an error; every
    cell that draws carries its image; a valid notebook, tidied as scripts/run_notebooks.py writes it."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    problems = [] if counts == list(range(1, len(code) + 1)) else [f"execution counts {counts}, not 1..{len(code)}"]
    errors = [n for n, c in enumerate(code, 1) if any(o.output_type == "error" for o in c.outputs)]
    problems += [f"code cells {errors} end in an error"] if errors else []
    blank = [n for n, c in enumerate(code, 1) if any(d in c.source for d in DRAWS) and not _has_image(c)]
    problems += [f"code cells {blank} draw a figure but carry no image/png output"] if blank else []
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as e:
        problems.append(f"invalid nbformat {nb.nbformat}.{nb.nbformat_minor}: {e.message}")
    if SCRIPT["tidy"](copy.deepcopy(nb)) != nb:
        problems.append("not tidied: timing or version metadata, or streams not collapsed")
    return problems


def _has_image(cell: nbformat.NotebookNode) -> bool:
    return any("image/png" in o.get("data", {}) for o in cell.outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_with_outputs(path):
    problems = committed_problems(nbformat.read(path, as_version=4))
    assert not problems, f"{path.name}: {'; '.join(problems)}: re-run it with `python scripts/run_notebooks.py`"


def test_committed_problems_are_found():
    """Each way a committed notebook can be stale or broken is reported (on copies of notebook 3)."""
    good = nbformat.read(NOTEBOOK_DIR / "03_the_dual.ipynb", as_version=4)
    assert committed_problems(good) == []

    def broken(change) -> list[str]:
        nb = copy.deepcopy(good)
        change([c for c in nb.cells if c.cell_type == "code"], nb)
        return committed_problems(nb)

    def no_outputs(code, nb):
        for c in code:
            c.outputs, c.execution_count = [], None

    def error(code, nb):
        code[1].outputs.append(nbformat.v4.new_output("error", ename="E", evalue="", traceback=[]))

    def no_image(code, nb):
        for c in code:
            c.outputs = [o for o in c.outputs if "image/png" not in o.get("data", {})]

    assert broken(no_outputs)[0].startswith("execution counts [None")
    assert broken(lambda code, nb: code.reverse() or nb.cells.reverse())[0].startswith("execution counts [")
    assert broken(error) == ["code cells [2] end in an error"]
    assert broken(no_image) == ["code cells [2, 3] draw a figure but carry no image/png output"]
    assert broken(lambda code, nb: nb.cells[0].update(id="abc"))[0].startswith("invalid nbformat 4.4:")
    untidy = ["not tidied: timing or version metadata, or streams not collapsed"]
    assert broken(lambda code, nb: code[0].metadata.update(execution={})) == untidy
    assert broken(lambda code, nb: nb.metadata.language_info.update(version="3.11")) == untidy
    assert broken(lambda code, nb: code[0].outputs.append(nbformat.v4.new_output("stream", text="\r"))) == untidy


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    assert nb.cells[-1].cell_type == "code" and "assert " in nb.cells[-1].source, "must end with an assertion cell"
    for cell in nb.cells:  # start from no outputs, so that every output checked below is this run's
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    before = sorted(NOTEBOOK_DIR.iterdir())
    SCRIPT["execute"](nb, tmp_path)  # raises CellExecutionError (with the cell and traceback) on any error
    assert sorted(NOTEBOOK_DIR.iterdir()) == before, "the notebook wrote into notebooks/"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    assert all(_has_image(c) for c in code if any(d in c.source for d in DRAWS)), "a figure was not drawn"
