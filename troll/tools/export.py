"""Export a LoRA run as a plain model folder: its newest checkpoint's adapters merged into the base, in float32,
with the tokenizer, for troll.tools.evaluate, vLLM or the hub.

    troll export runs/x --out runs/x/merged     # a run's newest checkpoint (or a checkpoint folder)

A command beside troll.lora rather than in it: it builds the run's model (troll.policy), which itself builds on
troll.lora, and the two modules stay free of each other's imports.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from troll.base.checkpoint import complete_checkpoints
from troll.base.cli import Parser
from troll.lora import is_adapter_checkpoint, merge
from troll.models.build import build_model, run_config


def export(source: str | Path, out: str | Path) -> Path:
    """Merge a run's newest checkpoint (or a checkpoint folder) into a plain model folder `out` in float32, with the
    tokenizer: what troll.tools.evaluate and vLLM load. ValueError names what is not a LoRA run or checkpoint."""
    source = Path(source)
    ckpt = (complete_checkpoints(source) or [None])[0] if (source / "checkpoints").is_dir() else source
    run = source if ckpt is not source else source.parent.parent
    if ckpt is None or not is_adapter_checkpoint(ckpt):
        raise ValueError(f"{source}: not a LoRA run directory or adapter checkpoint (no adapter_config.json)")
    cfg = dataclasses.replace(run_config(run), bf16=False)  # merged in float32
    model, tokenizer = build_model(cfg, torch.device("cpu"), path=ckpt)
    out = Path(out)
    merge(model).to(torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="troll export", description="Export a LoRA run as a merged model.")
    parser.add_argument("source", help="a LoRA run directory (its newest checkpoint) or one checkpoint folder")
    parser.add_argument("--out", required=True, help="the folder to write the merged model and tokenizer into")
    args = parser.parse_args(argv)
    if Path(args.out).exists():
        parser.error(f"--out {args.out} exists: give a new folder")
    try:
        path = export(args.source, args.out)
    except (ValueError, OSError, ImportError) as e:
        parser.error(str(e))
    print(f"merged model written to {path}")
    return 0


if __name__ == "__main__":
    from troll.base.cli import run_command

    run_command("troll export", main)
