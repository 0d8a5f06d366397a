"""Evaluate a model on a task: greedy pass@1, and pass@k and maj@k from sampled completions. The command:

    troll evaluate --model NAME_OR_PATH [--task T] [--data openai/gsm8k] [--chat auto] [--limit N]
        [--max_new_tokens 1024] [--samples N [--temperature 1.0] [--seed 0]] [--backend auto] [--out DIR]

Tasks (`--task`): every task troll.tasks.task builds, the choices of troll.base.config.Config's `task` field (addition,
rare, gsm8k, ...: `--help` lists them), so a task added there is scored with no change here. The test rows, the
prompt and the reward come from troll.tasks.task.load_task, given a Config: a troll run's own config.json for one of its
checkpoints (its settings hold, e.g. --reverse_sum), else Config's defaults for the task. `--limit N` is its eval_size
(the first N test problems; default: all of them), and no prompt is dropped for its length (max_prompt_len is
unbounded). The default task is the run's own when `--model` is a run directory or one of its checkpoints (a
checkpoint folder in <run>/checkpoints/ that holds trainer.pt, or whose <run>/config.json exists), else gsm8k; a
--task other than the run's is refused naming both (an addition model scores 0 on GSM8K, which measures nothing),
unless both are prompted and scored as GSM8K is (troll.tasks.task.GSM8K_FORMAT: a words run is scored on gsm8k too).
A run's config.json that is missing or damaged is named with the command that writes it again, as for a LoRA run.
`--data` and `--chat` act only with the tasks troll.base.config.ACTS_ONLY names for them (--data: gsm8k; --chat: gsm8k
and the tasks prompted as it is) and are refused, given with another task. `--data`: openai/gsm8k (default), another hub
name, a folder with test.jsonl (load_task reads its test.jsonl for both splits: a folder needs no train.jsonl) or
one .jsonl file. `--chat auto` (default) prompts through the chat template when the tokenizer has one (the tiny
addition models' tokenizers have none), `true` requires one.

Greedy pass@1, always: each problem's greedy completion scored with exactly the reward training uses (the task's).
Greedy decoding is the rollout backends' own `greedy` (rollout.HFGenerator, vllm_engine.VLLMGenerator), the path
training evaluates with too, so the numbers agree; it masks output ids past the tokenizer (Qwen's padded rows), as
the samplers do. Prompts are encoded, completions decoded and scored by troll.tasks.task, as in training. The backend:
vLLM when it is installed and a GPU or `--backend vllm` asks for it, else transformers `generate`.

Sampling (`--samples N`; 0, the default, is greedy only): N completions per problem through the backend's own
`sample` at `--temperature` (default 1.0; no top-k, top-p or penalties: troll.rollout), seeded by `--seed`
(default 0); it keeps no scores, so a call's memory is its KV cache. `--temperature` or `--seed` given without
`--samples` cannot act and is refused. The problems go in blocks (troll.tools.predictions: on hf, HF_BLOCK problems, the
greedy batch training evaluates in; on vLLM, VLLM_BLOCK), each block's greedy completions in one call and its
samples in calls of whole problems, N samples each and at most HF_CALL samples a call on hf, whose prompts are
forwarded once for their N samples (HFGenerator's share_prompt: the same tokens). Call c is seeded with the c-th
draw of random.Random(--seed): the same flags give the same samples on the same backend and machine. What the counts
imply is checked before the model loads (`too_many`): the completions kept, problems x (1 + N) x --max_new_tokens
tokens of KEPT_BYTES_PER_TOKEN, must fit in the memory free (troll.base.cli.free_memory), else one line names the three
counts; and on the hf backend the longest prompt and --max_new_tokens must fit in the model's positions
(`past_positions`). A completion stopped at --max_new_tokens is scored by what it completed, as in training
(troll.tasks.task.score: "#### 8" cut from 85 is no answer). For k = 1, 2, 4, ... below N, and N (`ks`):

    pass@k  the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k) for a problem with c of its
            n = N samples correct, in its product form (`pass_at_k`), averaged over problems; pass@1 is the mean
            sample reward
    maj@k   the share of problems whose most frequent answer among their first k samples equals the gold
            (`maj_at_k`): answers are grouped by the reward's equality, a sample without an answer casts no vote,
            and a tie goes to the answer that came first

A sample's answer and the equality (`answer_rule`): for a task scored by troll.tasks.gsm8k.reward (gsm8k, and any task
asked as it is), the answer gsm8k.extract_answer takes, compared by that reward's own cleaning and comparison
(`gsm8k_equal`: "42", "42.0" and "$42" are one answer); for any other task (addition, rare: an exact match), the
completion stripped, compared by the task's reward.

Output, into `--out` (default evals/<model name>), written as it goes once every check has passed: `predictions.jsonl`,
one line per problem appended as its block's calls return (question, gold, the greedy completion, its extracted answer
and reward, and with --samples, `samples`: each sample's completion, extracted answer and reward); `evaluation.json`,
the settings that decide them; and at the end `summary.json` (model, task, accuracy: greedy pass@1, n: problems,
backend, chat, seconds, samples; with --samples also temperature, seed, and `pass@k` and `maj@k`, each a dict keyed by
k), and one line per figure on stdout. Progress goes to stderr: a bar of problems on a terminal (samples done, time
left), else a line every PROGRESS_EVERY_S seconds. A stopped evaluation continues: the same command (the same settings,
model files and problems: troll.tools.predictions.read_done) keeps the problems in predictions.jsonl and computes the
rest, giving the lines an unstopped one gives; other settings, or files damaged (a line on stderr names the file, the
line and the field), start over. Its own files only (troll.base.outputs): the marker `.troll-evaluate`, written into
`--out` before them, lists the three, so an evaluation written there before is continued or replaced (summary.json is
removed first, each file written whole but predictions.jsonl's appended lines); a file of those names that
troll.tools.evaluate did not write (no marker lists it), a folder or a symbolic link of those names (never written
through) is refused in one line before the model is loaded, unchanged. Other files in `--out` are left as they are.

`--model` (troll.models.sources.resolve_model): a local folder holding a model and its tokenizer (config.json, weights,
tokenizer files); a run directory, whose `checkpoints/latest` checkpoint is evaluated (said on stderr); a LoRA run's
checkpoint (adapter_config.json, or a LoRA run directory), whose adapters are loaded on the run's base and merged in
memory in float32, as `troll export` merges them (with the hf backend: vLLM loads a model folder, which
troll.tools.export writes); a packaged model's name (`smollm2-135m-instruct`: troll.models.packaged makes its folder on
first use); or a hub name. A name is looked up once, with a short timeout: when the hub cannot be reached (or
HF_HUB_OFFLINE is set) a copy in the local cache is used, else the command stops at once instead of retrying. A
path that does not exist, a folder that lacks a model or tokenizer file (named) or holds a damaged one
(troll.base.checkpoint.damaged_file), a LoRA checkpoint whose run config or base is missing, an unknown hub name, bad
--data, a bad number or a flag that cannot act: a usage error, exit 2 with one line on stderr, before any model is
loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from troll.base import outputs
from troll.base.checkpoint import damage_remedy, damaged_file
from troll.base.cli import Parser, UsageError, free_memory, gib, run_command
from troll.models.sources import check_hub_data, is_adapters, lora_base, resolve_model
from troll.tasks import gsm8k
from troll.tasks.task import GSM8K_FORMAT, decode, encode, load_task, score, stopped
from troll.tools import predictions

if TYPE_CHECKING:
    from troll.base.config import Config
    from troll.rollout import Generator


HF_BLOCK = 64  # problems a block on the hf backend: HFGenerator's greedy batch, as training evaluates (predictions)
HF_CALL = 64  # samples a `sample` call on the hf backend, whose memory is its KV cache and one step's scores
VLLM_BLOCK = 256  # problems a block (and a call) on vLLM, which batches them itself
PROGRESS_EVERY_S = 30.0  # off a terminal, a progress line at most this often (and one at the end)
KEPT_BYTES_PER_TOKEN = 48  # a kept completion token: its id in a Python list and its decoded text (measured: 45)
# what it writes into --out, its marker listing them (troll.base.outputs)
OUTPUTS = ("predictions.jsonl", "summary.json", "evaluation.json")


def check_not_trained_on(model_path: str, rows: list[dict[str, str]], data: str) -> None:
    """A ValueError when the model is a troll run's checkpoint whose GSM8K training problems (a local --data of the
    run) include evaluated ones: a score on its own training problems is not a held-out accuracy."""
    config = Path(model_path).parent.parent / "config.json"  # <run>/checkpoints/step-N -> <run>/config.json
    try:
        run = json.loads(config.read_text())
    except (OSError, ValueError):
        return  # not a run's checkpoint (or its config is unreadable): nothing to compare with
    source = run.get("data", "") if run.get("task") == "gsm8k" else ""
    if not source or not Path(source).expanduser().exists():
        return  # the run trained on another task, or on the hub's train split, which shares no test problem
    try:
        gsm8k.check_held_out(gsm8k.load_gsm8k("train", source), rows, data)
    except ValueError as e:
        raise ValueError(f"{e} ({model_path} was trained on {source}: evaluate on held-out problems)") from None


def tasks() -> tuple[str, ...]:
    """The tasks --task accepts: those troll.tasks.task builds, the choices of troll.base.config.Config's `task`
    field."""
    from troll.base.config import Config  # imports no torch

    return tuple(next(f.metadata["choices"] for f in dataclasses.fields(Config) if f.name == "task"))


def trained_run(model_path: str) -> tuple[Path, Config] | None:
    """The run directory and config of the troll run whose checkpoint `model_path` is (module docstring), or None for
    any other model. The config is read as troll.models.build.run_config reads it, without importing torch: missing or
    not JSON, a ValueError naming it and the command that writes it again; a config that fails its checks, Config.load's
    ValueError naming the file."""
    from troll.base.config import Config

    ckpt = Path(model_path)
    run = ckpt.parent.parent
    path = run / "config.json"
    if ckpt.parent.name != "checkpoints" or not ((ckpt / "trainer.pt").exists() or path.exists()):
        return None
    again = (
        f"troll train --out {run} --resume true writes it again from the run's newest checkpoint (a "
        "finished run is not trained further)"
    )
    if not path.is_file():
        raise ValueError(f"{path} is missing, and it names the task {ckpt} was trained on: {again}")
    try:
        json.loads(path.read_bytes().decode("utf-8"))
    except ValueError:  # not UTF-8, not JSON
        raise ValueError(f"{path} is damaged (not JSON): {again}") from None
    return run, Config.load(path)


def ks(n: int) -> list[int]:
    """The k of pass@k and maj@k for n samples: 1, 2, 4, ... below n, and n itself."""
    out = []
    k = 1
    while k < n:
        out.append(k)
        k *= 2
    return [*out, n]


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one problem with c correct among its n samples, the unbiased estimator of Chen et al. (2021),
    "Evaluating Large Language Models Trained on Code", eq. 1: the chance that k of the n samples, drawn without
    replacement, include a correct one,

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

    and 1 when n - c < k (every k of them include one). The product never forms the binomials, which overflow a
    float from n of about 1,030. ValueError unless 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def maj_at_k(answers: Sequence[str | None], gold: str, k: int, equal: Callable[[str, str], bool]) -> float:
    """maj@k of one problem: 1.0 when the most frequent answer among its first k samples equals `gold`, else 0.0.

    answers[j] is sample j's extracted answer, None where it has none (it casts no vote). Each answer joins the first
    group whose first answer it equals (equal(first, answer)), else opens a group, so answers equal by value are one
    answer ("42", "42.0" and "$42" under gsm8k_equal). The group with the most votes wins, a tie going to the group
    whose first answer came first; it is right when equal(its first answer, gold). No vote among the k: 0.0.
    ValueError unless 1 <= k <= len(answers)."""
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj@k needs 1 <= k <= {len(answers)} (the samples), got k={k}")
    groups: list[list[Any]] = []  # [first answer, votes], in order of first occurrence
    for answer in answers[:k]:
        if answer is None:
            continue
        group = next((g for g in groups if equal(g[0], answer)), None)
        if group is None:
            groups.append([answer, 1])
        else:
            group[1] += 1
    if not groups:
        return 0.0
    winner = max(groups, key=lambda g: g[1])  # the first of the largest: ties go to the earliest answer
    return float(equal(winner[0], gold))


def gsm8k_equal(answer: str, gold: str) -> bool:
    """Whether an extracted answer equals `gold` (or another answer) by troll.tasks.gsm8k.reward's own rule: the reward
    of a completion that states `answer` after "####", so both are cleaned and compared as the reward does ("42" ==
    "42.0" == "$42" == "42 dollars"; "142" != "42")."""
    return gsm8k.reward("#### " + answer.replace("\n", " "), gold) == 1.0


def answer_rule(reward: Callable[[str, str], float]) -> tuple[Callable[[str], str | None], Callable[[str, str], bool]]:
    """How maj@k reads a sample's answer and compares two, for a task with reward `reward`: GSM8K's extraction and
    equality for a task scored by troll.tasks.gsm8k.reward; else the completion stripped (empty: no answer), compared by
    the reward itself (addition, rare: an exact match)."""
    if reward is gsm8k.reward:
        return gsm8k.extract_answer, gsm8k_equal
    return (lambda text: text.strip() or None), (lambda answer, gold: reward(answer, gold) == 1.0)


def too_many(problems: int, samples: int, max_new_tokens: int, free: int | None) -> str | None:
    """Why an evaluation of `problems` problems, each with its greedy completion and `samples` sampled ones of up to
    `max_new_tokens` tokens, cannot keep its completions in `free` bytes (KEPT_BYTES_PER_TOKEN each token), or None
    when it can (or `free` is unknown). Checked before the model loads, so an absurd count is one line, not a
    MemoryError after the model's loading."""
    kept = problems * (1 + samples) * max_new_tokens * KEPT_BYTES_PER_TOKEN
    if free is None or kept <= free:
        return None
    return (
        f"{problems} problems x (1 + --samples {samples}) completions x --max_new_tokens {max_new_tokens} tokens keep "
        f"up to {gib(kept)} of completions in memory, more than the {gib(free)} free here: pass a smaller --samples, "
        "--max_new_tokens or --limit"
    )


def past_positions(generator: Generator, longest_prompt: int, max_new_tokens: int) -> str | None:
    """Why the longest prompt and --max_new_tokens run past the positions of the hf backend's model
    (config.max_position_embeddings, where generation degrades and transformers warns at every token), or None:
    they fit, or the backend checks its own (vLLM's max_model_len)."""
    config = getattr(getattr(generator, "model", None), "config", None)
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int) or longest_prompt + max_new_tokens <= positions:
        return None
    room = positions - longest_prompt
    fix = f"pass at most {room}" if room > 0 else "pass a smaller --limit, or a model with more positions"
    return (
        f"--max_new_tokens {max_new_tokens} after the longest prompt ({longest_prompt} tokens) runs past the model's "
        f"{positions} positions: {fix}"
    )


def load_generator(backend: str, model_path: str, tokenizer: Any, max_model_len: int) -> Generator:
    """A rollout backend ("hf" or "vllm") holding the model at `model_path` (a LoRA checkpoint: merged, hf only),
    for its `greedy` and `generate` methods."""
    import torch

    if backend == "vllm":
        from troll.models.vllm_engine import VLLMGenerator

        on_gpu = torch.cuda.is_available()
        dtype = "auto" if on_gpu else "float32"  # vLLM's "auto" runs a float32 checkpoint in 16 bits
        return VLLMGenerator(
            model_path, tokenizer, max_model_len, dtype=dtype, gpu_memory_utilization=0.9, sleep_level=None
        )

    from transformers import AutoModelForCausalLM

    from troll.models.attention import use_gqa_attention
    from troll.models.build import load
    from troll.rollout import HFGenerator

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if is_adapters(Path(model_path)):
        model = merged_lora(Path(model_path), device)
    else:
        model = load(AutoModelForCausalLM.from_pretrained, model_path, "model").to(device)
        use_gqa_attention(model)  # on CPU: shared key/value heads read in place (troll.models.attention)
    # share_prompt: a prompt forwarded once for its samples
    return HFGenerator(model.eval(), tokenizer, max_model_len, share_prompt=True)


def merged_lora(ckpt: Path, device: Any) -> Any:
    """A LoRA checkpoint's adapters on its run's base, merged in float32 (as troll.tools.export writes it)."""
    from troll.lora import merge
    from troll.models.build import build_model

    cfg, _ = lora_base(ckpt)
    cfg = dataclasses.replace(cfg, bf16=False, grad_checkpointing=False)  # merged in float32, no training
    model, _ = build_model(cfg, device, path=ckpt)
    return merge(model)


def prediction(
    row: dict, greedy: list[int], samples: list[list[int]], tokenizer: Any, spec: Any, eos: Sequence[int], limit: int
) -> dict:
    """One problem's line of predictions.jsonl: its question, gold, greedy completion, extracted answer, reward and
    `cut` (stopped at the token limit `limit`: scored by what it completed, as in training, troll.tasks.task.score), and
    with samples, each one's completion, extracted answer, reward and cut."""
    extract, _ = answer_rule(spec.reward)
    texts, finished = decode(tokenizer, [greedy, *samples]), stopped([greedy, *samples], limit, eos)
    _, records = score([row] * len(texts), texts, spec.reward, finished, spec.cut)
    records = [
        rec | {"extracted": extract(rec["completion"]), "cut": not f} for rec, f in zip(records, finished, strict=True)
    ]
    line = records[0]
    if samples:
        line["samples"] = [{k: rec[k] for k in ("completion", "extracted", "reward", "cut")} for rec in records[1:]]
    return line


def figures(lines: Sequence[dict], reward: Callable[[str, str], float]) -> tuple[dict[str, float], dict[str, float]]:
    """pass@k and maj@k over the problems' samples (module docstring), keyed by k as a string (JSON's keys)."""
    _, equal = answer_rule(reward)
    n = len(lines[0]["samples"])
    passed, majority = {}, {}
    same = [functools.cache(equal) for _ in lines]  # one problem's comparisons, made once for every k
    for k in ks(n):
        passed[str(k)] = sum(pass_at_k(n, sum(s["reward"] == 1.0 for s in x["samples"]), k) for x in lines) / len(lines)
        majority[str(k)] = sum(
            maj_at_k([s["extracted"] for s in x["samples"]], x["gold"], k, eq)
            for x, eq in zip(lines, same, strict=True)
        ) / len(lines)
    return passed, majority


def main(argv: list[str] | None = None) -> dict:
    from troll.base.config import ACTS_ONLY, Config

    p = Parser(prog="troll evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model folder, a run directory or a hub name")
    p.add_argument(
        "--task",
        default=None,
        choices=tasks(),
        help="the task to score (default: the run's own for a run directory or checkpoint, else gsm8k)",
    )
    p.add_argument(
        "--data",
        default=None,
        help=f"--task gsm8k: a hub name, a folder with test.jsonl, or a .jsonl file (default {gsm8k.HUB_NAME})",
    )
    p.add_argument(
        "--chat",
        default=None,
        choices=["auto", "true", "false"],
        help="the tasks prompted as GSM8K: prompts through the chat template (default auto: when the tokenizer has "
        "one)",
    )
    p.add_argument("--limit", type=int, default=None, help="the first N test problems (default: all)")
    p.add_argument("--max_new_tokens", type=int, default=1024, help="the longest completion, in tokens (default 1024)")
    p.add_argument(
        "--samples",
        type=int,
        default=0,
        help="sampled completions per problem, for pass@k and maj@k (default 0: greedy pass@1 only)",
    )
    p.add_argument("--temperature", type=float, default=None, help="the samples' temperature (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="seeds the samples (default 0)")
    p.add_argument("--backend", default="auto", choices=["auto", "hf", "vllm"])
    p.add_argument("--out", default=None, help="output folder (default: evals/<model name>)")
    args = p.parse_args(argv)

    def fail(message: str) -> NoReturn:
        """A usage error: one line on stderr, exit 2 (no usage text: the flags parsed)."""
        p.exit(2, f"{p.prog}: error: {message}\n")

    if not args.model.strip():
        fail("--model must not be empty")
    if args.data is not None and not args.data.strip():
        fail(f"--data must not be empty (leave it out for {gsm8k.HUB_NAME})")
    if args.out is not None and not args.out.strip():
        fail("--out must not be empty (leave it out for evals/<model name>)")
    if args.limit is not None and args.limit < 1:
        fail(f"--limit must be >= 1, got {args.limit}")
    if args.limit is not None and args.limit > sys.maxsize:
        fail(f"--limit must be at most {sys.maxsize} (leave it out for every row), got {args.limit}")
    if args.max_new_tokens < 1:
        fail(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.samples < 0:
        fail(f"--samples must be >= 0 (0: greedy pass@1 only), got {args.samples}")
    for flag in ("temperature", "seed"):
        if getattr(args, flag) is not None and not args.samples:
            fail(f"--{flag} acts only with --samples N > 0 (sampled completions): pass --samples N, or drop --{flag}")
    temperature = 1.0 if args.temperature is None else args.temperature
    if not 0 < temperature < math.inf:  # nan fails every comparison
        fail(f"--temperature must be > 0 and finite, got {args.temperature}")
    seed = 0 if args.seed is None else args.seed
    out = Path(args.out or Path("evals") / Path(args.model).name)
    written = outputs.Marked(out, "troll.evaluate", OUTPUTS, "--out")  # its own files: .troll-evaluate lists them
    if file := next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None):
        fail(f"--out {out}: {file} is a file, not a folder: choose another --out")
    try:
        outputs.check(written.targets())
    except UsageError as e:
        fail(str(e))
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        fail("--backend vllm needs the optional vllm package, which is not installed: pass --backend hf")
    try:
        model_path, note = resolve_model(args.model, adapters=True)
        run = trained_run(model_path)
    except (OSError, ValueError) as e:
        fail(str(e))
    trained_on = run[1].task if run else None
    task = args.task or trained_on or "gsm8k"
    if trained_on and task != trained_on and not {task, trained_on} <= set(GSM8K_FORMAT):
        fail(f"--task {task}: {args.model} was trained on {trained_on}; pass --task {trained_on} (or leave --task out)")
    for flag in ("data", "chat"):  # the settings troll.base.config says act only with some tasks
        _, acts, when = ACTS_ONLY[flag]
        if getattr(args, flag) is not None and not acts(task):
            why = f" ({args.model} was trained on {task})" if trained_on and args.task is None else ""
            fail(f"--{flag} acts only with {when}, not --task {task}{why}: drop --{flag}")
    data = args.data or gsm8k.HUB_NAME
    reads_data = ACTS_ONLY["data"][1](task)
    if reads_data:
        try:
            check_hub_data(data)
            rows = gsm8k.load_gsm8k("test", source=data, limit=args.limit)
            check_not_trained_on(model_path, rows, data)
        except (OSError, ValueError) as e:
            fail(str(e))
    lora = is_adapters(Path(model_path))
    if lora and args.backend == "vllm":
        fail(
            f"--backend vllm loads a model folder, and {model_path} holds LoRA adapters: merge them with "
            f"troll export {model_path} --out DIR and evaluate DIR, or pass --backend hf"
        )
    if note:
        print(f"{p.prog}: {note}", file=sys.stderr)
    if Path(model_path).is_dir() and (problem := damaged_file(Path(model_path))):
        fail(f"{problem}: {damage_remedy(Path(model_path))}")
    import torch  # after the checks: a usage error answers without loading torch
    from transformers import AutoTokenizer

    from troll.models.build import load

    tokenizer = load(AutoTokenizer.from_pretrained, model_path, "tokenizer")
    chat = None  # the setting, where it acts
    if ACTS_ONLY["chat"][1](task):
        chat = tokenizer.chat_template is not None if args.chat in (None, "auto") else args.chat == "true"
        if chat and tokenizer.chat_template is None:
            fail(f"--chat true, but the tokenizer of {args.model} has no chat template")
    settings: dict[str, Any] = {"task": task, "eval_size": args.limit or 0, "max_prompt_len": sys.maxsize}
    if reads_data:  # a local folder as its test.jsonl, which load_task reads for both splits
        local = Path(data).expanduser()
        settings["data"] = str(local / "test.jsonl" if local.is_dir() else local) if local.exists() else data
    if chat is not None:
        settings["chat"] = chat
    try:
        spec, _ = load_task(dataclasses.replace(run[1], **settings) if run else Config(**settings), tokenizer)
    except (OSError, ValueError) as e:
        fail(str(e))
    rows = spec.test
    if problem := too_many(len(rows), args.samples, args.max_new_tokens, free_memory()):
        fail(problem)
    prompts = encode(tokenizer, [spec.prompt(r["question"]) for r in rows])
    backend = args.backend
    if backend == "auto":  # a LoRA checkpoint is merged in memory, which the hf backend evaluates
        backend = "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") and not lora else "hf"
    asked = hashlib.sha256(json.dumps([[r["question"], r["gold"]] for r in rows]).encode()).hexdigest()
    state = {"model": Path(model_path).name, "weights": predictions.weights_stamp(model_path), "task": task,
             "data": settings.get("data"), "chat": chat, "problems": len(rows), "questions": asked, "backend": backend,
             "max_new_tokens": args.max_new_tokens, "samples": args.samples, "temperature": temperature,
             "seed": seed}  # fmt: skip
    try:
        done = predictions.read_done(out, state, rows) or []
    except ValueError as e:  # a SchemaError too: its own files, damaged, are written again
        print(f"{p.prog}: {e}", file=sys.stderr)
        done = []
    if done:
        print(
            f"{p.prog}: continuing the evaluation in {out}: {len(done)} of {len(rows)} problems done", file=sys.stderr
        )
    start = time.time()
    max_model_len = max(len(x) for x in prompts) + args.max_new_tokens
    generator = load_generator(backend, model_path, tokenizer, max_model_len)
    if problem := past_positions(generator, max_model_len - args.max_new_tokens, args.max_new_tokens):
        fail(problem)
    block, per_call = (VLLM_BLOCK, VLLM_BLOCK * max(args.samples, 1)) if backend == "vllm" else (HF_BLOCK, HF_CALL)
    try:
        written.claim()  # checked again, the folder made and marked, before any file
        written.target("summary.json").path.unlink(missing_ok=True)  # it summarised the predictions replaced here
        with outputs.writing(written.target("predictions.jsonl")) as f:  # the lines to continue from (or none)
            f.writelines(json.dumps(line) + "\n" for line in done)
        outputs.write(written.target("evaluation.json"), json.dumps({"settings": state}, indent=2) + "\n")
    except UsageError as e:  # a file of those names that appeared while the model loaded
        fail(str(e))
    work = predictions.completions(
        generator, prompts, args.samples, args.max_new_tokens, temperature, seed, block, per_call, start=len(done)
    )
    progress, eos = Progress(len(rows), len(done), args.samples), generator.eos_token_ids
    with open_append(written.target("predictions.jsonl").path) as f:
        for finished in work:  # the problems a call finished
            for i, greedy, drawn in finished:
                done.append(prediction(rows[i], greedy, drawn, tokenizer, spec, eos, args.max_new_tokens))
                f.write(json.dumps(done[-1]) + "\n")
            f.flush()
            progress.update(len(finished))
    progress.close()
    acc = sum(line["reward"] for line in done) / len(done)
    summary = {"model": args.model, "task": task, "accuracy": acc, "n": len(rows), "backend": backend, "chat": chat}
    summary["samples"] = args.samples
    lines = [f"{task} greedy pass@1: {acc:.4f} ({len(rows)} problems, {backend}) -> {out}"]  # one line per figure
    if args.samples:
        passed, majority = figures(done, spec.reward)
        summary |= {"temperature": temperature, "seed": seed, "pass@k": passed, "maj@k": majority}
        how = f"({len(rows)} problems, {args.samples} samples each at temperature {temperature}, seed {seed})"
        for name, values in (("pass", passed), ("maj", majority)):
            lines += [f"{task} {name}@{k}: {value:.4f} {how}" for k, value in values.items()]
    summary["seconds"] = round(time.time() - start, 1)
    try:
        outputs.write(written.target("summary.json"), json.dumps(summary, indent=2) + "\n")
    except UsageError as e:  # a file of that name that appeared while the model worked
        fail(str(e))
    print("\n".join(lines))
    return summary


def open_append(path: Path) -> Any:
    """The predictions file, opened to append its lines, never through a symbolic link."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    return os.fdopen(fd, "a", encoding="utf-8")


class Progress:
    """The evaluation's progress on stderr: a tqdm bar of problems on a terminal (samples done beside it, time left
    by tqdm's rate), else a line at most every PROGRESS_EVERY_S seconds and at the end: problems and samples done,
    time spent and left."""

    def __init__(self, total: int, done: int, samples: int) -> None:
        from tqdm.auto import tqdm

        self.total, self.first, self.done, self.samples = total, done, done, samples
        self.t0 = self.said = time.time()
        self.bar = tqdm(total=total, initial=done, unit="problem", desc="evaluate", disable=None, file=sys.stderr)

    def update(self, problems: int) -> None:
        if not problems:
            return
        self.done += problems
        self.bar.update(problems)
        if self.samples:
            self.bar.set_postfix(samples=self.done * self.samples, refresh=False)
        now = time.time()
        if self.bar.disable and (now - self.said >= PROGRESS_EVERY_S or self.done == self.total):
            self.said, spent = now, now - self.t0
            left = spent / (self.done - self.first) * (self.total - self.done)
            print(
                f"evaluate: {self.done}/{self.total} problems, {self.done * self.samples} samples, {spent:.0f} s spent,"
                f" about {left:.0f} s left",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()


if __name__ == "__main__":
    run_command("troll evaluate", main)
