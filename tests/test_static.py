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


def test_the_kernel_is_importable_from_the_package_without_loading_it_on_import():
    code = (
        "import sys, agentloop\n"
        "assert 'agentloop.kernel' not in sys.modules, 'import agentloop loaded the kernel'\n"
        "from agentloop import Kernel, NoSuchProcess, Process, Receipt, Signal\n"
        "from agentloop.kernel import Kernel as K\n"
        "assert Kernel is K and 'Kernel' in agentloop.__all__\n"
        "assert 'bashlex' not in sys.modules, 'the shell parser (0.2 s to build) loaded before a shell command'\n"
        "try:\n    agentloop.Nope\nexcept AttributeError as e:\n    assert 'Nope' in str(e)\n"
        "else:\n    raise SystemExit('no AttributeError')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
