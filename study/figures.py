"""The study's figures from its results file, drawn by troll.plot.plot_study (PNG):

python -m study.figures study/results.jsonl --out study/figures/
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from troll.plot import plot_study, read_results


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m study.figures", description="Figures of study/run.py's results")
    p.add_argument("results", help="the results file (JSONL) that study/run.py wrote")
    p.add_argument("--out", default="study/figures", help="folder for the PNGs; default: %(default)s")
    args = p.parse_args(argv)
    rows = read_results(args.results)
    if not rows:
        p.error(f"{args.results} holds no finished runs")
    for path in plot_study(rows, args.out):
        print(path)


if __name__ == "__main__":
    main()
