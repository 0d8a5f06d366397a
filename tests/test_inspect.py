"""troll.inspect: the text summary and the self-contained page (quick, from written records), the command's one-line
refusals (subprocess), the page in headless Chromium (rendered DOM, colouring, both runs, a screenshot, no network),
and real tiny-rare runs of every loss writing records that survive a resume."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from troll import inspect as tinspect
from troll import records
from troll.cli import UsageError
from troll.config import Config

ROOT = Path(__file__).resolve().parents[1]


def row(step: int, loss: str) -> dict:
    """A records row with one rewarded completion ending in the rare `#`, projected under the KL ball and cut by
    the clip, and one tricky token text (a closing script tag)."""
    sample = {"index": 7, "adv": 2.47, "reward": 1.0, "prompt": "04+85=", "text": ["9", "8", "0", "#", "</script>"],
              "q": [0.5, 0.6, 0.9, 0.01, 0.2], "p": [0.52, 0.6, 0.9, 0.016, 0.2],
              "p_after": [0.55, 0.61, 0.9, 0.05, 0.2], "kl": [1e-4, 0.0, 0.0, 0.09, 0.0],
              "projected": [0, 0, 0, 1, 0], "ratio": [1.04, 1.0, 1.0, 1.6, 1.0],
              "ratio_proj": [1.04, 1.0, 1.0, 1.3, 1.0], "clipped": [0, 0, 0, 1, 0]}  # fmt: skip
    return {"step": step, "loss": loss, "eps": 0.05, "clip_low": 0.2, "clip_high": 0.2, "level": "token",
            "samples": [sample]}  # fmt: skip


def fake_run(root: Path, name: str, loss: str, steps=(5, 10)) -> Path:
    out = root / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"task": "rare", "loss": loss, "eps": 0.05, "lr": 3e-4}))
    (out / records.FILE).write_text("".join(json.dumps(row(s, loss)) + "\n" for s in steps))
    return out


def test_page_is_self_contained_and_holds_both_runs(tmp_path):
    a, b = fake_run(tmp_path, "troll", "troll"), fake_run(tmp_path, "ppo", "ppo_clip")
    shown = [(str(r), *tinspect.load(str(r))) for r in (a, b)]
    step = tinspect.pick_step(shown, None)
    assert step == 10
    page = tinspect.page([(n, c, tinspect.at_step(rows, step)) for n, c, rows in shown])
    assert not re.search(r"https?://|src=|href=|@import|url\(", page)  # nothing to fetch
    assert page.count("<script") == 2 and "</script>\"" not in page  # the token text cannot end the script early
    data = json.loads(re.search(r'id="data">(.*?)</script>', page, re.S).group(1))
    assert [r["loss"] for r in data["runs"]] == ["troll", "ppo_clip"] and data["runs"][0]["step"] == 10
    assert data["runs"][0]["samples"][0]["text"][-1] == "</script>"
    text = tinspect.text_summary(str(a), shown[0][1], tinspect.at_step(shown[0][2], 10))
    assert "1 projected (KL > eps), 1 that PPO-clip would cut" in text and "'#'" in text


def test_steps_and_files_are_refused_with_the_way_forward(tmp_path):
    a, b = fake_run(tmp_path, "a", "troll", (5, 10)), fake_run(tmp_path, "b", "ppo_clip", (5,))
    shown = [(str(r), *tinspect.load(str(r))) for r in (a, b)]
    assert tinspect.pick_step(shown, None) == 5
    with pytest.raises(UsageError, match=r"--step 10 is not recorded in every run .*b: 5"):
        tinspect.pick_step(shown, 10)
    with pytest.raises(UsageError, match="is not a run directory"):
        tinspect.load(str(tmp_path / "nowhere"))
    (tmp_path / "c").mkdir()
    with pytest.raises(UsageError, match="config.json does not exist"):
        tinspect.load(str(tmp_path / "c"))
    (b / "config.json").write_text("[1]")
    with pytest.raises(UsageError, match="does not hold a JSON object"):
        tinspect.load(str(b))


# ----------------------------------------------------------------------------- the command


def command(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "troll.inspect", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip


def refused(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[0].startswith("python -m troll.inspect: error: ") and all(w in lines[0] for w in words), lines[0]


@pytest.mark.slow
def test_the_command_prints_writes_and_refuses_in_one_line(tmp_path):
    a, b = fake_run(tmp_path, "a", "troll"), fake_run(tmp_path, "b", "ppo_clip")
    done = command(str(a), str(b), "--step", "5", "--out", str(tmp_path / "page.html"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "at step 5" in done.stdout and (tmp_path / "page.html").is_file()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    torn = fake_run(tmp_path, "torn", "troll")
    (torn / records.FILE).write_text("{no json\n" + json.dumps(row(1, "troll")) + "\n")
    cases = [
        ((str(tmp_path / "none"),), ("none", "is not a run directory")),
        ((str(tmp_path / "empty"),), ("tokens.jsonl does not exist", "--records_samples")),
        ((str(torn),), ("tokens.jsonl line 1", "resume the run")),
        ((str(a), "--step", "7"), ("--step 7 is not recorded",)),
        ((str(a), "--ste", "5"), ("--ste",)),
        ((str(a), str(a), str(a)), ("at most two runs",)),
        ((str(a), "--out", str(tmp_path / "no" / "page.html")), ("its folder does not exist",)),
    ]
    for argv, words in cases:
        refused(command(*argv), *words)


# ----------------------------------------------------------------------------- in a real browser


def chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)


def browse(page: Path, *flags: str) -> subprocess.CompletedProcess:
    """Headless Chromium on `page` behind a dead proxy: nothing can be fetched, so what renders came from the file."""
    argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>", *flags, page.as_uri()]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(chromium() is None, reason="no chromium here: apt-get install -y chromium (.ci/run installs it)")
def test_the_page_renders_in_headless_chromium_without_network(tmp_path):
    a, b = fake_run(tmp_path, "troll-run", "troll"), fake_run(tmp_path, "ppo-run", "ppo_clip")
    out = tmp_path / "page.html"
    assert command(str(a), str(b), "--out", str(out)).returncode == 0
    html = out.read_text()
    assert not re.search(r"https?://", html)
    dom = browse(out, "--dump-dom").stdout  # the DOM after the page's script ran
    assert 'data-ready="1"' in dom and 'data-colour="kl"' in dom
    runs = re.findall(r'<section class="run" data-run="(\d)" data-loss="(\w+)"', dom)
    assert runs == [("0", "troll"), ("1", "ppo_clip")]
    tokens = re.findall(r'<span class="tok[^"]*"[^>]*style="background-color: (rgb\([^)]*\))[^>]*>([^<]*)</span>', dom)
    assert len(tokens) == 10 and [t for _, t in tokens[:4]] == ["9", "8", "0", "#"]
    colours = {t: c for c, t in tokens}
    assert colours["#"] != colours["8"]  # the projected `#` is coloured apart from a token inside the ball
    assert '<span class="tok over"' in dom and "&lt;/script&gt;" in dom  # framed above eps; the text shown as text
    shot = tmp_path / "page.png"
    browse(out, f"--screenshot={shot}", "--window-size=1200,700", "--hide-scrollbars")
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000


# ----------------------------------------------------------------------------- real runs


def train(out: Path, *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "troll.train", "--preset", "tiny-rare", "--out", str(out), "--steps", "2",
            "--sft_steps", "20", "--sft_target", "0", "--prompts_per_step", "4", "--eval_size", "20",
            "--eval_every", "1", "--save_every", "1", *flags]  # fmt: skip
    if "--resume" in flags:  # a resumed run keeps the settings in its config.json
        argv = [sys.executable, "-m", "troll.train", "--out", str(out), *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["troll", "ppo_clip", "dppo", "cispo"])
def test_a_tiny_rare_run_of_each_loss_writes_records_that_resume_cuts_back(tmp_path, loss):
    out = tmp_path / loss
    done = train(out, "--loss", loss)
    assert done.returncode == 0, done.stderr[-3000:]
    rows, bound = records.read(out), records.row_bytes_bound(Config.load(out / "config.json"))
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] == loss for r in rows)
    for r in rows:
        assert len(r["samples"]) == 4 and len((json.dumps(r) + "\n").encode()) <= bound
        for s in r["samples"]:
            assert all(v is not None for k in records.FIELDS for v in s[k])  # p_after read after the update
    # a crash after step 2's rows were written and before its checkpoint: resume drops them and writes them again
    (out / "summary.json").unlink()
    shutil.rmtree(out / "checkpoints" / "step-000002")
    (out / "checkpoints" / "latest").write_text("step-000001")
    again = train(out, "--resume", "true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert records.read(out) == rows  # step 2 again, as the uninterrupted run recorded it
