"""Packaged models (troll.models.packaged): the folder made from the GGUF file loads to the same logits, is made once
and reused, and a missing package or a damaged folder is one line saying what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from troll.base.cli import UsageError
from troll.models import packaged
from troll.models.tiny import save_tiny, tiny_llama, train_tokenizer

NAME = "smollm2-135m-instruct"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TROLL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


@pytest.fixture
def tiny_make(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """`_make` replaced by a tiny model's save (the real one reads a 98 MB GGUF): the folders it was asked to make."""
    made: list[Path] = []

    def make(gguf: Path, work: Path) -> None:
        tokenizer = train_tokenizer(["1+1=2"], vocab_size=64)
        save_tiny(tiny_llama(tokenizer, hidden=16, layers=1, heads=2), tokenizer, work)
        files = {p.name: p.stat().st_size for p in sorted(work.iterdir()) if p.is_file()}
        (work / packaged.RECORD).write_text(json.dumps({"source": str(gguf), "files": files}))
        made.append(work)

    monkeypatch.setattr(packaged, "_make", make)
    monkeypatch.setattr(packaged, "source_file", lambda name: Path("/the/package") / packaged.MODELS[name].file)
    return made


def test_a_folder_is_made_once_then_reused_and_resolve_maps_only_packaged_names(cache, tiny_make):
    first = packaged.folder(NAME, quiet=True)
    assert first == cache / NAME and packaged.damage(first) is None
    assert packaged.folder(NAME) == first and len(tiny_make) == 1  # reused, not made again
    assert not list(cache.glob(".*making*"))  # the working folder is gone after its rename
    assert packaged.resolve(NAME) == str(first)
    assert packaged.resolve("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    with pytest.raises(ValueError, match="not a packaged model"):
        packaged.folder("gpt2")


@pytest.mark.parametrize("damage", ["record", "truncated", "missing", "garbled record"])
def test_a_damaged_folder_is_named_with_delete_and_never_deleted(cache, tiny_make, damage):
    folder = packaged.folder(NAME, quiet=True)
    victim = {"record": folder / packaged.RECORD, "garbled record": folder / packaged.RECORD}.get(
        damage, folder / "model.safetensors"
    )
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:100])
    elif damage == "garbled record":
        victim.write_text('{"files": ')
    else:
        victim.unlink()
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(UsageError, match=f"delete {folder}") as e:
        packaged.folder(NAME)
    assert str(victim) in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in folder.iterdir()) == before and len(tiny_make) == 1  # nothing deleted or remade


def test_a_missing_package_or_file_says_what_to_install(cache, monkeypatch):
    monkeypatch.setitem(packaged.MODELS, "absent", packaged.Packaged("no-such-pkg", "no_such_pkg_troll", "m.gguf"))
    with pytest.raises(UsageError, match="needs the no-such-pkg package, which is not installed: pip install"):
        packaged.folder("absent")
    monkeypatch.setitem(packaged.MODELS, "nofile", packaged.Packaged("pytest", "pytest", "missing.gguf"))
    with pytest.raises(UsageError, match="missing.gguf is missing from the pytest package"):
        packaged.folder("nofile")
    assert not cache.exists() or not any(cache.iterdir())  # nothing written before the checks


def test_the_command_refuses_an_unknown_name_in_one_line():
    done = subprocess.run([sys.executable, "-m", "troll", "model", "gpt2"], capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "gpt2" in done.stderr


@pytest.mark.parametrize("cache", ["a-file", "a-file/under", ""])
def test_troll_cache_that_cannot_hold_the_folder_is_one_line(tmp_path, cache, monkeypatch):
    """$TROLL_CACHE under a file: one line naming it (or the missing package), exit 2, the file unchanged; blank:
    the default cache."""
    (tmp_path / "a-file").write_text("mine")
    env = dict(os.environ, TROLL_CACHE=str(tmp_path / cache) if cache else "")
    if not cache:
        monkeypatch.setenv("TROLL_CACHE", "")
        assert packaged.cache_root() == Path.home() / ".cache" / "troll" / "models"
        return
    done = subprocess.run([sys.executable, "-m", "troll", "model", NAME], capture_output=True, text=True, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "a-file" in lines[0] or "not installed" in lines[0]
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.slow
def test_the_made_folder_loads_to_the_gguf_models_logits_and_tokenizer(cache):
    """The real conversion from the installed package (README's install), run as the command with its output piped
    (a log): one line saying the folder is being made, its path on stdout, and no progress bar (the conversion's and
    the weights' loading drew about 50 lines here before). Then against transformers' own GGUF load on a prompt other
    than the one the conversion checks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = subprocess.run([sys.executable, "-m", "troll", "model", NAME], capture_output=True, text=True, timeout=600)
    folder = cache / NAME
    assert done.returncode == 0 and done.stdout == f"{folder}\n", done.stderr[-3000:]
    assert done.stderr.startswith(f"making {folder} from ") and len(done.stderr.splitlines()) == 1, done.stderr[-3000:]
    assert "\r" not in done.stderr and packaged.damage(folder) is None
    gguf = packaged.source_file(NAME)
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model, tok = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "Natalia sold 48 clips."}], tokenize=False)
    assert text == ref_tok.apply_chat_template([{"role": "user", "content": "Natalia sold 48 clips."}], tokenize=False)
    ids = tok(text, return_tensors="pt").input_ids
    assert torch.equal(ids, ref_tok(text, return_tensors="pt").input_ids)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>" and model.config.model_type == "llama"
    assert not hasattr(model.config, "quantization_config")
