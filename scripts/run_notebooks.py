"""Execute the notebooks top to bottom and write their outputs into them, so that every figure shows where the
repository is browsed (GitHub renders committed outputs).

    python scripts/run_notebooks.py                                  # every notebooks/*.ipynb
    python scripts/run_notebooks.py notebooks/03_the_dual.ipynb      # only the ones named

Each notebook runs with nbclient on the `python3` kernel, which ipykernel installs inside the virtualenv (this
interpreter; nothing is registered globally), in a fresh temporary working directory, so that a notebook cannot write
into the repository. The kernel imports this checkout's `troll` (its root leads PYTHONPATH). The written file leaves
out per-cell timing and the interpreter's version, and holds printed streams as Jupyter shows them (`tidy`), so that
re-running changes only what the cells print and draw (images are new bytes every time). tests/test_notebooks.py runs
the same `execute` without writing back.

OMP_WAIT_POLICY=PASSIVE: on a shared, busy CPU, OpenMP threads that spin while waiting make torch ~10x slower; it must
be set before the kernel imports torch. MPLBACKEND: matplotlib draws inline, as in Jupyter. The kernel draws no
progress bars (KERNEL_ENV).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbformat import NotebookNode

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
KERNEL = "python3"
CELL_TIMEOUT_S = 300
KERNEL_ENV = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    # Progress bars redraw a terminal line; written into a notebook they are hundreds of stderr frames.
    "TQDM_DISABLE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
IGNORE_WARNINGS = "ignore:IProgress not found"  # tqdm.auto's notice that, without ipywidgets, it draws text bars


def execute(nb: NotebookNode, cwd: Path) -> NotebookNode:
    """Run every cell of `nb` in place, in working directory `cwd`; CellExecutionError (naming the cell, with its
    traceback) on the first error or failed assertion. Returns `nb` with its outputs, tidied (`tidy`)."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    client = NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=CELL_TIMEOUT_S,
        startup_timeout=120,
        record_timing=False,
        resources={"metadata": {"path": str(cwd)}},  # the kernel's working directory
    )
    warnings = ",".join(w for w in (os.environ.get("PYTHONWARNINGS", ""), IGNORE_WARNINGS) if w)
    client.execute(env=os.environ | KERNEL_ENV | {"PYTHONPATH": pythonpath, "PYTHONWARNINGS": warnings})
    return tidy(nb)


def tidy(nb: NotebookNode) -> NotebookNode:
    """In place: drop what changes from run to run without the notebook changing (per-cell timing metadata, the
    interpreter's version), and write each cell's streams as Jupyter shows them: consecutive stdout (stderr) outputs
    merged, each line only what follows its last carriage return, blank ones dropped. Execution counts stay."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = _collapse_streams(cell.outputs)
    nb.metadata.get("language_info", {}).pop("version", None)
    return nb


def _collapse_streams(outputs: list[NotebookNode]) -> list[NotebookNode]:
    outputs = _merge_streams(outputs)
    for out in outputs:
        if out.output_type == "stream":
            lines = out.text.replace("\r\n", "\n").split("\n")
            out.text = "\n".join(line.rsplit("\r", 1)[-1] for line in lines)
    return _merge_streams([out for out in outputs if out.output_type != "stream" or out.text.strip()])


def _merge_streams(outputs: list[NotebookNode]) -> list[NotebookNode]:
    """Consecutive stream outputs of one name (stdout or stderr) as one, in place of the first."""
    merged: list[NotebookNode] = []
    for out in outputs:
        if out.output_type == "stream" and merged and merged[-1].get("name") == out.name:
            merged[-1].text += out.text
        else:
            merged.append(out)
    return merged


def run(path: Path) -> None:
    """Execute the notebook at `path` in a fresh temporary directory and write it back with its outputs."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix=f"nb-{path.stem}-") as cwd:
        execute(nb, Path(cwd))
    nbformat.validate(nb)  # ValidationError, naming the problem, rather than writing an invalid notebook
    nbformat.write(nb, path)


def main(argv: list[str]) -> None:
    paths = [Path(a).resolve() for a in argv] or sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    bad = [str(p) for p in paths if p.suffix != ".ipynb" or not p.is_file()]
    if bad:
        raise SystemExit(f"not a notebook file: {', '.join(bad)}")
    for path in paths:
        start = time.perf_counter()
        run(path)
        print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
