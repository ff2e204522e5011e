"""The code stays clean: ruff over everything, mypy (strict) over the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff():
    proc = _run("ruff", "check", "src", "tests", "bench")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict():
    proc = _run("mypy")
    assert proc.returncode == 0, proc.stdout + proc.stderr
