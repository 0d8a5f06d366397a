"""The benchmarks (bench/README.md), a package so that each script runs both ways from the repository root:
`python bench/step.py` (the script puts the repository root on sys.path) and `python -m bench.step`."""
