"""Shared test fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Small CPU models run ~10x slower when OpenMP threads spin-wait for a core another process holds (a shared
# 2-core machine). Set before torch is imported by any test module.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """Local GSM8K copy ({train,test}.jsonl): $TROLL_GSM8K_DIR, else ../shared/data/gsm8k beside the repo."""
    default = Path(__file__).resolve().parents[2] / "shared/data/gsm8k"
    path = Path(os.environ.get("TROLL_GSM8K_DIR", default))
    if not (path / "test.jsonl").is_file():
        raise FileNotFoundError(f"GSM8K data not found at {path}: set TROLL_GSM8K_DIR to a folder with test.jsonl")
    return path
