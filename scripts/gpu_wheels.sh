#!/usr/bin/env bash
# The wheels a GPU lease machine lacks, downloaded here into .whl/ (git ignores it) for scripts/gpu_lease.sh to
# install there with no network. That machine (docs/usage.md, "On a rented GPU") has Python 3.12, torch with CUDA,
# transformers, peft, accelerate, pytest, scipy and matplotlib, and no math-verify (troll.gsm8k imports it at the
# top), no vLLM, TRL or datasets (troll imports those only where they are used; the lease runs none of them).
#   bash scripts/gpu_wheels.sh       # prints the wheels' and the tree's size: they travel together, <= 64 MiB
set -euo pipefail
cd "$(dirname "$0")/.."
# Pure-Python wheels (py3-none-any), the versions tested here; --no-deps: each one the machine lacks is named.
WHEELS=(math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2)
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl "${WHEELS[@]}"
ls .whl | wc -l | grep -qx "${#WHEELS[@]}" || { echo "gpu_wheels.sh: expected ${#WHEELS[@]} wheels in .whl" >&2; exit 1; }
# What a device call sends: the tracked and untracked-not-ignored files, plus the carried .whl (64 MiB at most).
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "gpu_wheels.sh: ${#WHEELS[@]} wheels, $((wheels / 1024)) KiB; the tree $((tree / 1024)) KiB; together" \
    "$(((tree + wheels) / 1024)) KiB of the 65,536 KiB a call carries"
((tree + wheels <= 64 * 1024 * 1024)) || { echo "gpu_wheels.sh: over 64 MiB: a lease call would refuse it" >&2; exit 1; }
