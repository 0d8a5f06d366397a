"""The token inspector's committed figure, made by one command: two tiny-rare runs (TROLL, PPO-clip) as README's
"See it" commands make them, the files of theirs the page reads, and the page's screenshot.

    python -m study.inspect_figure                                 # docs/figures: about 2 minutes on 2 cores
    python -m study.inspect_figure --records_only --out /tmp/fig   # the runs' files only (no browser needed)

writes, under --out (default docs/figures):

    inspect_tiny_rare/troll/, inspect_tiny_rare/ppo/   each run's config.json, tokens.jsonl (troll.run.records) and
                                                       metrics.jsonl with its evaluation rows only ({"step",
                                                       "eval_acc"}: troll.tools.inspect reads the accuracy there; the
                                                       other rows hold wall-clock times, which no two runs share)
    inspect_tiny_rare.png                              `troll inspect troll ppo --step STEP` in headless
                                                       Chromium at the page's default view, the shared sample's `#`
                                                       pinned in both panels

The runs train as `troll train --preset tiny-rare --records_every 5 [--loss ppo_clip]` with PyTorch, MKL
and oneDNN held to their AVX2 kernels and 2 threads, and MKL in its strict reproducible mode (PINNED), so that the
CPU's make and the thread count do not enter the bytes (tests/test_inspect.py checks the committed files against a
fresh run). What is shown and what is not: MKL's documentation promises its strict AVX2 mode the same gemm results on
every Intel CPU with AVX2 whatever the thread count; on one Intel Xeon with AVX-512 and AMX two runs give the same
bytes, and 1 thread gives the bytes of 2. No second CPU was at hand to compare with, and on other makers' CPUs
(AMD) MKL takes its own code paths, which this mode does not cover (docs/results.md, "The token inspector's
figure"). The folders are the command's own (a marker,
troll.base.outputs): a file it did not write there is refused in one line, never replaced; so is a figure without its
mark (PNG text Software=study.inspect_figure). Every check comes before the first run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

from troll.base import outputs
from troll.base.cli import Parser, UsageError, run_command

PROG = "python -m study.inspect_figure"
ROOT = Path(__file__).resolve().parent.parent
STEP = 10  # the step the screenshot shows: both runs sample the same rewarded `#` completion there
RUNS = {"troll": [], "ppo": ["--loss", "ppo_clip"]}  # each folder's extra flags on README's command
FILES = ("config.json", "tokens.jsonl", "metrics.jsonl")
BY = "study.inspect_figure"  # the name that marks its files (troll.base.outputs)
# The runs' kernels, whatever the CPU: ATen's and oneDNN's AVX2 code, and MKL's AVX2 branch in strict conditional
# numerical reproducibility (MKL_CBWR). Without MKL_CBWR, MKL picks its kernels and blocking by the CPU's model and
# cache sizes; in strict mode its gemm (the only MKL routine these runs call: MKL_VERBOSE) gives the same bits on
# every Intel CPU with AVX2 and any thread count (MKL's documentation; here MKL_NUM_THREADS=1 changes the run's bytes
# without it, and not with it). Threads are fixed too: 2, and neither MKL nor OpenMP may change that at run time
# (MKL_DYNAMIC, OMP_DYNAMIC), as MKL's reproducibility conditions ask.
PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "AVX2,STRICT",
          "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "MKL_DYNAMIC": "FALSE",
          "OMP_DYNAMIC": "FALSE", "OMP_WAIT_POLICY": "PASSIVE"}  # fmt: skip
SIZE = "1400,900"  # the screenshot's window, pixels


def chromium() -> str | None:
    """A Chromium to screenshot the page with, or None."""
    return next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


def browse(url: str, *flags: str) -> subprocess.CompletedProcess:
    """Headless Chromium on `url` behind a dead proxy: nothing can be fetched, so what renders came from the file."""
    argv = [chromium() or "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>", *flags, url]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def marked_png(png: bytes, by: str) -> bytes:
    """`png` with the text entry Software=<by> after its header chunk (troll.base.outputs.figure tells its own by
    it)."""
    if png[:8] != outputs.PNG_SIGNATURE:
        raise UsageError("the browser wrote no PNG screenshot: run it again, or pass --records_only")
    body = b"tEXt" + b"Software\0" + by.encode()
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    end_of_header = 8 + 8 + struct.unpack(">I", png[8:12])[0] + 4
    return png[:end_of_header] + chunk + png[end_of_header:]


def train(work: Path, name: str) -> Path:
    """README's tiny-rare run `name` in `work` (its config.json names runs/tiny-rare-<name>, as README's does)."""
    out = f"runs/tiny-rare-{name}"
    argv = [sys.executable, "-m", "troll", "train", "--preset", "tiny-rare", "--records_every", "5", *RUNS[name],
            "--out", out]  # fmt: skip
    env = os.environ | PINNED | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        said = (done.stdout.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"the {name} run failed ({said}): run `{' '.join(argv[1:])}` to see why")
    print(done.stdout.strip().splitlines()[-1])
    return work / out


def files_of(run: Path) -> dict[str, bytes]:
    """What the figure keeps of a run: its config, its records and its evaluations (metrics.jsonl read through its
    schema, troll.run.runfiles)."""
    from troll.run.runfiles import read_metrics

    evals = [{"step": r["step"], "eval_acc": r["eval_acc"]} for r in read_metrics(run) if "eval_acc" in r]
    return {"config.json": (run / "config.json").read_bytes(), "tokens.jsonl": (run / "tokens.jsonl").read_bytes(),
            "metrics.jsonl": "".join(json.dumps(r) + "\n" for r in evals).encode()}  # fmt: skip


def pins(folder: Path) -> str:
    """The page address's pins: the `#` of the first sample at STEP that both runs drew alike, in both panels
    (tokens.jsonl read through troll.run.records' schema)."""
    from troll.run import records
    from troll.tools.inspect import at_step

    rows = {name: at_step(records.read(folder / name), STEP) for name in RUNS}
    other = {s["index"]: s["text"] for s in rows["ppo"]["samples"]}
    for s in rows["troll"]["samples"]:
        if "#" in s["text"] and other.get(s["index"]) == s["text"]:
            return ",".join(f"{r}.{s['index']}.{s['text'].index('#')}" for r in range(2))
    return ""


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures"), help="the folder of the figure and its "
                        "runs' files (default: docs/figures)")  # fmt: skip
    parser.add_argument("--records_only", action="store_true", help="the runs' files only, no screenshot")
    args = parser.parse_args(argv)
    if not args.out.strip():
        parser.error("--out is empty: give a folder")
    out = Path(args.out).expanduser() / "inspect_tiny_rare"
    folders = {name: outputs.Marked(out / name, BY, FILES, "--out") for name in RUNS}
    shot = outputs.figure(out.with_suffix(".png"), BY, "--out")
    outputs.check([t for m in folders.values() for t in m.targets()] + ([] if args.records_only else [shot]))
    browser = None if args.records_only else chromium()
    if not args.records_only and browser is None:
        raise UsageError("no chromium here for the screenshot: install it (apt-get install chromium), or pass "
                         "--records_only")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="inspect_figure-") as tmp:
        work = Path(tmp)
        runs = {name: train(work, name) for name in RUNS}
        made = {name: files_of(run) for name, run in runs.items()}
        for name, marked in folders.items():
            marked.claim()
            for file, data in made[name].items():
                outputs.write(marked.target(file), data)
            print(f"wrote {marked.folder}/{{{','.join(FILES)}}}")
        if args.records_only:
            return
        from troll.tools import inspect

        page = work / "page.html"
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.chdir(work):
            inspect.main([str(run.relative_to(work)) for run in runs.values()] + ["--step", str(STEP), "--out",
                         str(page)])  # fmt: skip
        png = work / "shot.png"
        url = f"{page.as_uri()}#pin={pins(out)}"
        browse(url, f"--screenshot={png}", f"--window-size={SIZE}", "--hide-scrollbars")
        if not png.is_file():
            raise UsageError(f"{browser} wrote no screenshot: run it again, or pass --records_only")
        outputs.check([shot])
        outputs.write(shot, marked_png(png.read_bytes(), BY))
        print(f"wrote {shot.path}")


if __name__ == "__main__":
    run_command(PROG, main)
