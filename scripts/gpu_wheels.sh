#!/usr/bin/env bash
# The wheels a GPU lease machine lacks, downloaded here into .whl/ (git ignores it) for scripts/gpu_lease.sh to
# install there with no network. That machine (docs/usage.md, "On a rented GPU") has Python 3.12, torch with CUDA,
# transformers, peft, accelerate, pytest, scipy and matplotlib, and no math-verify (troll.tasks.gsm8k imports it at the
# top), no vLLM, TRL or datasets (troll imports those only where they are used; the lease runs none of them).
#   bash scripts/gpu_wheels.sh       # prints the wheels' and the tree's size: they travel together, <= 64 MiB
# The new wheels are downloaded into .whl/.new and replace the earlier ones only once every one is there and the
# size fits: a failed or interrupted download leaves .whl/ as it was. .whl/ holds this script's wheels alone:
# anything else there (or .whl not a folder) is refused before anything is written, and left as it is.
set -uo pipefail
cd "$(dirname "$0")/.."
PROG="bash scripts/gpu_wheels.sh"
# Pure-Python wheels (py3-none-any), the versions tested here; --no-deps: each one the machine lacks is named.
WHEELS=(math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2)
NEW=.whl/.new # the download, until it is complete

fail() { # fail STATUS MESSAGE...: the one line, and the exit status (2: something to fix before it runs)
    echo "$PROG: error: ${*:2}" >&2
    exit "$1"
}

# Everything checkable, before anything is written.
if [[ -L .whl || (-e .whl && ! -d .whl) ]]; then
    fail 2 ".whl is not a folder: move it away (this script writes its wheels there)"
fi
if [[ -d .whl ]]; then
    shopt -s nullglob dotglob
    for f in .whl/*; do
        if [[ "$f" != "$NEW" && ! ("$f" == *.whl && -f "$f" && ! -L "$f") ]]; then
            fail 2 "$f is not one of this script's wheels: move it out of .whl/ (which this script replaces)"
        fi
    done
    shopt -u nullglob dotglob
    [[ -w .whl ]] || fail 2 ".whl is not writable by you: make it writable (chmod, chown, chattr -i)"
else
    [[ -w . ]] || fail 2 "$PWD is not writable by you, so .whl cannot be made there: make it writable"
fi
command -v python3 >/dev/null || fail 2 "python3 is not a command: activate the project's Python (.venv)"
git rev-parse --git-dir >/dev/null 2>&1 || fail 2 "$PWD is not a git checkout: run this in the repository"

made=0
[[ -d .whl ]] || made=1
cleanup() { # the download's folder, and .whl itself when this run made it and it is still empty
    rm -rf "$NEW"
    if ((made)); then rmdir .whl 2>/dev/null; fi
}
trap cleanup EXIT
trap 'cleanup; echo "$PROG: interrupted: no wheel replaced (.whl/ as it was)" >&2; trap - INT; kill -INT $$' INT

mkdir -p .whl && rm -rf "$NEW" && mkdir "$NEW" || fail 1 "cannot write $NEW: see the line above"
if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$NEW" "${WHEELS[@]}" \
    2>"$NEW/pip.log"; then
    said=$(grep -v '^\s*$' "$NEW/pip.log" | tail -1)
    fail 1 "pip download failed (${said:-no message}): .whl/ left as it was; check the network and run it again"
fi
rm -f "$NEW/pip.log"
got=("$NEW"/*.whl)
[[ -e "${got[0]}" && ${#got[@]} == "${#WHEELS[@]}" ]] || fail 1 "expected ${#WHEELS[@]} wheels, pip gave ${#got[@]}" \
    "(.whl/ left as it was): check WHEELS in this script"
# What a device call sends: the tracked and untracked-not-ignored files, plus the carried .whl (64 MiB at most).
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
wheels=$(du -cb "${got[@]}" | tail -1 | cut -f1)
((tree + wheels <= 64 * 1024 * 1024)) || fail 1 "the tree and the wheels are over 64 MiB, which a lease call" \
    "would refuse (.whl/ left as it was)"

# The swap: Ctrl-C waits for it (mv and rm ignore it too), so .whl/ holds the old wheels or the new ones.
trap '' INT
rm -f .whl/*.whl && mv "${got[@]}" .whl/ && rmdir "$NEW" || fail 1 "replacing the wheels in .whl/ failed: run it again"
made=0
trap - INT
echo "$PROG: ${#WHEELS[@]} wheels, $((wheels / 1024)) KiB; the tree $((tree / 1024)) KiB; together" \
    "$(((tree + wheels) / 1024)) KiB of the 65,536 KiB a call carries"
