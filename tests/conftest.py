"""Shared test fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Small CPU models run ~10x slower when OpenMP threads spin-wait for a core another process holds (a shared
# 2-core machine). Set before torch is imported by any test module.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

GSM8K_SAMPLE = Path(__file__).resolve().parent / "data" / "gsm8k"
GSM8K_FULL_ROWS = {"train": 7473, "test": 1319}  # openai/gsm8k, config main
GSM8K_SAMPLE_ROWS = {"train": 200, "test": 100}  # the head of each split (tests/data/gsm8k/README.md)
TEST_DEVICES = ("cuda", "cpu")  # $TROLL_TEST_DEVICE: where tests/test_gpu.py runs (default cuda)


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """GSM8K folder ({train,test}.jsonl): $TROLL_GSM8K_DIR (a full copy) when set, else the committed sample
    tests/data/gsm8k (its README.md)."""
    path = Path(os.environ["TROLL_GSM8K_DIR"]) if os.environ.get("TROLL_GSM8K_DIR") else GSM8K_SAMPLE
    missing = [name for name in ("train.jsonl", "test.jsonl") if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"GSM8K data not found: {path} has no {' or '.join(missing)} (TROLL_GSM8K_DIR)")
    return path


@pytest.fixture(scope="session")
def gsm8k_rows(gsm8k_dir: Path) -> dict[str, int]:
    """Rows per split in `gsm8k_dir`: the sample's, or the full data set's for $TROLL_GSM8K_DIR."""
    return GSM8K_SAMPLE_ROWS if gsm8k_dir == GSM8K_SAMPLE else GSM8K_FULL_ROWS


def pytest_addoption(parser: pytest.Parser) -> None:
    """--fuzz-examples N: examples per command in the slow fuzz test (tests/test_fuzz.py; its default otherwise)."""
    parser.addoption(
        "--fuzz-examples", type=int, default=None, help="examples per command in tests/test_fuzz.py's slow test"
    )


def pytest_configure(config: pytest.Config) -> None:
    """$TROLL_TEST_DEVICE other than cuda or cpu is one usage error for the whole run (pytest exits 4), not an error
    in every test that uses the device."""
    name = os.environ.get("TROLL_TEST_DEVICE", "cuda")
    if name not in TEST_DEVICES:
        raise pytest.UsageError(
            f"TROLL_TEST_DEVICE={name!r}: give cuda (the default; tests/test_gpu.py skips without a GPU) or cpu (the "
            "same tests on CPU)"
        )
