#!/usr/bin/env bash
# One GPU lease, prepared: every GPU check this repository has, in order of value, inside one time budget.
#
#   bash scripts/gpu_wheels.sh                 # here, once: the wheels the GPU machine lacks, into .whl/
#   bash scripts/gpu_lease.sh OUT              # there (device tool: carry .whl): about 8 minutes on an H100
#   bash scripts/gpu_lease.sh --cpu OUT        # here: the rehearsal, the same parts at CPU sizes (a few minutes)
#
# LEASE_BUDGET_S (whole seconds, >= 20; default 480) bounds the whole; LEASE_PARTS (default: all) picks parts by
# file (env checks projection tests rare) or by the name lease.log gives them. Each setting and OUT (a new or empty
# folder you can write to) is checked before anything is written; Ctrl-C stops the running part and the rest,
# keeps what finished and says so. The parts, their files and the exit statuses: scripts/gpu_lease.py, which this
# runs with $PYTHON (default python3; the standard library and troll.base.cli only: no network, no package index needed).
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null; then
    echo "bash scripts/gpu_lease.sh: error: PYTHON=$PY is not a command: set PYTHON to the project's Python" >&2
    exit 2
fi
exec "$PY" "$(dirname "$0")/gpu_lease.py" "$@"
