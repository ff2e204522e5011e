"""The code stays clean: ruff over everything, mypy (strict) over the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
MYPY_TEST = "tests/test_static.py::test_mypy_strict"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


class _Background:
    """mypy over the package, started when the session is collected (``conftest.py`` calls
    ``start_mypy`` when ``test_mypy_strict`` is selected): a cold run takes ~25 s of one core,
    which it spends while the other tests mostly wait on sockets and subprocesses, instead of
    alone at its turn. Niced, so the tests it runs beside get the CPU first. The test checks the
    same run's exit code and output as before."""

    proc: subprocess.Popen[bytes] | None = None
    out: IO[bytes] | None = None


def start_mypy() -> None:
    if _Background.proc is not None:
        return
    _Background.out = tempfile.TemporaryFile()  # noqa: SIM115 (closed by _mypy or stop_mypy)
    nice = shutil.which("nice")
    _Background.proc = subprocess.Popen(
        [*([nice, "-n", "10"] if nice else []), sys.executable, "-m", "mypy"],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=_Background.out,
        stderr=subprocess.STDOUT,
    )


def stop_mypy() -> None:
    """At the session's end: a run nobody collected (the test deselected, or the session ended
    early) is stopped, not left behind."""
    proc, out = _Background.proc, _Background.out
    _Background.proc = _Background.out = None
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(10)
    if out is not None:
        out.close()


def _mypy() -> tuple[int, str]:
    """The exit code and output of mypy: of the run started at collection, or of one started now."""
    start_mypy()
    proc, out = _Background.proc, _Background.out
    assert proc is not None and out is not None
    try:
        code = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    finally:
        _Background.proc = None
    out.seek(0)
    text = out.read().decode(errors="replace")
    out.close()
    _Background.out = None
    return code, text


def test_ruff():
    proc = _run("ruff", "check", "src", "tests", "bench")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict():
    code, output = _mypy()
    assert code == 0, output


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
