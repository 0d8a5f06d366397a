#!/usr/bin/env bash
# One GPU lease, prepared: every GPU check this repository has, in order of value, inside one time budget.
#
#   bash scripts/gpu_wheels.sh                 # here, once: the wheels the GPU machine lacks, into .whl/
#   bash scripts/gpu_lease.sh OUT              # there (device tool: carry .whl): about 8 minutes on an H100
#   bash scripts/gpu_lease.sh --cpu OUT        # here: the rehearsal, the same parts at CPU sizes (a few minutes)
#
# Parts, each written into OUT as it runs (tee), so a lease stopped at its limit still returns what finished:
#   env.txt         GPU, driver (nvidia-smi), torch, CUDA, every package troll imports against its pin
#   tests.txt       python -m pytest -m gpu tests/test_gpu.py (--cpu: TROLL_TEST_DEVICE=cpu runs them on CPU)
#   projection.txt  bench/projection.py: TROLL against PPO-clip (same gather) at V = 151,936, bf16, N = 8,192 and
#                   16,384 tokens; time and peak memory as ratios, against the paper's ~10% time / ~5% memory
#   checks.txt      python -m troll.check at the gsm8k-qwen2.5-0.5b, gsm8k-qwen3-1.7b-lora and gsm8k-qwen3-4b-lora
#                   shapes: random-weight stand-ins, transformers backend, bf16, a small batch (--cpu: --shape tiny)
#   rare.txt        with the time left: the rare-token sequence task (tiny-rare) at a 32,768-token vocabulary,
#                   TROLL and PPO-clip on paired seeds, each run's held-out accuracy
#   lease.log       each part's exit status and seconds, and the budget left
# The lease's limit leaves out runs/ (checkpoints): the parts' run folders live under a temporary folder.
# LEASE_BUDGET_S (default 480) bounds the whole; each part gets at most its own cap and what is left.
# LEASE_PARTS (default "env tests projection checks rare") picks parts by file or by the name lease.log gives
# them (check-gsm8k-qwen3-4b-lora, say), so a second lease runs what the first missed.
set -uo pipefail
cd "$(dirname "$0")/.."

CPU=0
if [[ "${1:-}" == "--cpu" ]]; then CPU=1; shift; fi
if [[ $# -ne 1 ]]; then
    echo "usage: bash scripts/gpu_lease.sh [--cpu] OUT   (OUT: the folder that receives each part's results)" >&2
    exit 2
fi
OUT=$1
mkdir -p "$OUT" 2>/dev/null || { echo "gpu_lease.sh: cannot create $OUT: choose a writable folder" >&2; exit 2; }
if [[ -n "$(ls -A "$OUT")" ]]; then echo "gpu_lease.sh: $OUT is not empty: choose an empty folder" >&2; exit 2; fi
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
BUDGET=${LEASE_BUDGET_S:-480}
START=$SECONDS
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_WAIT_POLICY=PASSIVE

log() { echo "$*" | tee -a "$OUT/lease.log"; }

# part NAME FILE CAP CMD...: CMD under the smaller of CAP and the budget left (SIGINT first: troll's commands stop
# cleanly on it), its output appended to OUT/FILE as it comes; a part with under 20 s left, or with neither its
# name nor its file's in LEASE_PARTS, is skipped.
PARTS=" ${LEASE_PARTS:-env tests projection checks rare} "
part() {
    local name=$1 file=$2 cap=$3 left t0 rc
    shift 3
    if [[ "$PARTS" != *" ${file%.txt} "* && "$PARTS" != *" $name "* ]]; then
        log "part $name: skipped (not in LEASE_PARTS)"
        return 0
    fi
    left=$((BUDGET - (SECONDS - START)))
    if ((left < 20)); then
        log "part $name: skipped (${left} s of the budget left)"
        return 0
    fi
    ((cap < left)) || cap=$left
    t0=$SECONDS
    echo "\$ $*" >>"$OUT/$file"
    timeout --signal=INT --kill-after=15 "$cap" "$@" >>"$OUT/$file" 2>&1
    rc=$?
    log "part $name: exit $rc in $((SECONDS - t0)) s$( ((rc == 124)) && echo " (stopped at its ${cap} s cap)")"
}

# The wheels (scripts/gpu_wheels.sh) go to a folder of their own on the path; the repository is imported as is.
SITE="$WORK/site"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
        || { log "gpu_lease.sh: the wheels in .whl/ did not install: run bash scripts/gpu_wheels.sh again"; exit 1; }
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
log "gpu_lease.sh $([[ $CPU == 1 ]] && echo "--cpu ")$OUT: budget $BUDGET s, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [[ $CPU == 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    log "gpu_lease.sh: torch sees no CUDA GPU: run the rehearsal with --cpu, or run this on the GPU machine"
    "$PY" scripts/gpu_env.py >>"$OUT/env.txt" 2>&1
    exit 1
fi

# 1. the environment
part env env.txt 60 "$PY" scripts/gpu_env.py

# 2. the tests that only a GPU can run (--cpu: the same tests on CPU, the CUDA-only ones skipped)
if [[ $CPU == 1 ]]; then export TROLL_TEST_DEVICE=cpu; fi
part tests tests.txt 180 "$PY" -m pytest -m gpu tests/test_gpu.py -q -rA -p no:cacheprovider

# 3. the loss at Qwen's vocabulary: TROLL against PPO-clip, time and peak memory
if [[ $CPU == 1 ]]; then
    part projection projection.txt 120 "$PY" bench/projection.py --n 256 --v 8192 --repeats 1
else
    for n in 8192 16384; do
        part "projection-n$n" projection.txt 90 "$PY" bench/projection.py --device cuda --dtype bfloat16 --n $n \
            --repeats 5
    done
fi

# 4. the acceptance check at the GSM8K presets' shapes (stand-ins: no hub here), transformers backend
if [[ $CPU == 1 ]]; then
    part check-tiny checks.txt 120 "$PY" -m troll.check --shape tiny --backend hf --device cpu --steps 1 \
        --out "$WORK/check-tiny"
else
    for preset in gsm8k-qwen2.5-0.5b gsm8k-qwen3-1.7b-lora gsm8k-qwen3-4b-lora; do
        part "check-$preset" checks.txt 180 "$PY" -m troll.check --preset "$preset" --model standin --backend hf \
            --prompts 4 --samples 4 --max_new_tokens 64 --eval_size 4 --steps 2 --out "$WORK/check-$preset"
    done
fi

# 5. with the time left: the rare-token sequence task at a 32,768-token vocabulary, paired seeds
device=$([[ $CPU == 1 ]] && echo cpu || echo cuda)
vocab=$([[ $CPU == 1 ]] && echo 1024 || echo 32768)
steps=$([[ $CPU == 1 ]] && echo 2 || echo 40)
for seed in 0 1 2; do
    for loss in troll ppo_clip; do
        part "rare-$loss-seed$seed" rare.txt 120 "$PY" -m troll.train --preset tiny-rare --loss "$loss" \
            --seed $seed --vocab_size "$vocab" --device "$device" --steps "$steps" --eval_every "$steps" \
            --save_every "$steps" --out "$WORK/rare-$loss-$seed"
    done
    [[ $CPU == 1 ]] && break
done
log "gpu_lease.sh: done in $((SECONDS - START)) s of $BUDGET"
