"""A Shell output too long for the result is kept whole in a file of the workspace
(``.agentloop/outputs/``, ``process_group.KeptOutput``) that the cut names and Read pages through:
the middle a cut leaves out is still there to read, where running the command again could repeat
its effects or print something else.

Real commands, real files; the sandboxed case needs Landlock, as tests/test_sandbox_private11.py
does (``AGENTLOOP_TEST_NO_LANDLOCK=1`` skips it on a machine known to have none)."""

from __future__ import annotations

import asyncio
import os
import re
import stat
from pathlib import Path

import pytest

from agentloop.process.approval.engine import decide
from agentloop.process.approval.policy import default_policy
from agentloop.process.approval.tags import call_tags
from agentloop.tools import process_group, sandbox
from agentloop.tools.fs import read_file
from agentloop.tools.shell import run_shell
from tests.test_background_control import Runtime, jobs, output_of, start
from tests.test_background_shell import until
from tests.test_tools_shell import text

MIDDLE = "UNIQUE-MIDDLE-LINE-7f3a"
# ~2 MB: 300,000 numbered lines with one of its own in the middle (line 150,001)
BIG = f"seq 1 150000; echo {MIDDLE}; seq 150001 300000"
BIG_OUTPUT = (
    "".join(f"{i}\n" for i in range(1, 150001)) + f"{MIDDLE}\n" + "".join(f"{i}\n" for i in range(150001, 300001))
).encode()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    return ws.resolve()


def outputs(root: Path) -> Path:
    return root / process_group.OUTPUT_DIR


def kept_files(root: Path) -> list[str]:
    folder = outputs(root)
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".txt") if folder.is_dir() else []


async def test_a_cut_output_is_kept_whole_and_the_cut_names_the_file_read_pages_through(root: Path) -> None:
    result = await run_shell(root, BIG)
    out = text(result)
    assert out.startswith("1\n2\n3\n") and out.endswith("299999\n300000\n[exit code 0]")
    assert MIDDLE not in out and len(out) < 31_000
    assert result.details["truncated"] is True
    name = result.details["output_file"]
    assert re.fullmatch(r"\.agentloop/outputs/\d{8}-\d{6}-[0-9a-f]{8}\.txt", name)
    note = re.search(
        r"… \d+ bytes omitted: lines (\d+)–(\d+) of 300001 not shown; the full output \(.*?\) "
        r"is kept in (\S+): Read it with offset/limit",
        out,
    )
    assert note is not None, out[14_000:16_000]
    first, last = int(note[1]), int(note[2])
    assert note[3] == name and first < 150001 < last
    # the head shows lines up to the one the note says is the first not shown (in part at most)
    head = out[: out.index("\n…")].split("\n")
    assert len(head) == first and head[-2] == str(first - 1)

    kept = root / name
    assert kept.read_bytes() == BIG_OUTPUT  # byte for byte, the middle too
    page = await read_file(root, name, 150000, 3)
    assert text(page).splitlines()[:3] == ["150000\t150000", "150001\t" + MIDDLE, "150002\t150001"]


async def test_the_file_is_private_and_the_directory_ignored_by_git(root: Path) -> None:
    result = await run_shell(root, BIG)
    kept = root / result.details["output_file"]
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert stat.S_IMODE(outputs(root).stat().st_mode) == 0o700
    assert stat.S_IMODE((root / ".agentloop").stat().st_mode) == 0o700
    assert (root / ".agentloop" / ".gitignore").read_text().splitlines()[-1] == "*"


async def test_an_output_that_fits_leaves_no_file(root: Path) -> None:
    result = await run_shell(root, "seq 1 100")
    assert result.details["truncated"] is False and "output_file" not in result.details
    assert not (root / ".agentloop").exists()
    # past what is held of the head (so a file was begun) but not cut after all: 600 four-byte
    # characters are 2400 bytes but only 600 of the 1000 characters allowed
    wide = await run_shell(root, "for i in $(seq 600); do printf '\\360\\237\\230\\200'; done", max_output=1000)
    assert wide.details["truncated"] is False and "output_file" not in wide.details
    assert text(wide).startswith("😀" * 600)
    assert kept_files(root) == []


async def test_the_oldest_files_go_first_past_the_total_caps(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process_group, "MAX_KEPT_FILES", 3)
    names = []
    for i in range(5):
        result = await run_shell(root, f"echo run-{i}; seq 1 5000", max_output=200)
        names.append(Path(result.details["output_file"]).name)
    other = outputs(root) / "mine.txt"  # (not a name the runtime gives: never removed)
    other.write_text("keep me")
    assert kept_files(root) == sorted([*names[2:], "mine.txt"])
    assert (outputs(root) / names[-1]).read_text().startswith("run-4\n1\n")

    monkeypatch.setattr(process_group, "MAX_KEPT_FILES", 200)
    size = (outputs(root) / names[-1]).stat().st_size
    monkeypatch.setattr(process_group, "MAX_KEPT_TOTAL", 2 * size + size // 2)  # room for two
    result = await run_shell(root, "echo run-5; seq 1 5000", max_output=200)
    latest = Path(result.details["output_file"]).name
    assert kept_files(root) == sorted([names[-1], latest, "mine.txt"])
    assert other.read_text() == "keep me"


async def test_an_output_over_the_per_output_cap_keeps_its_head_and_tail_and_says_so(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process_group, "MAX_KEPT_BYTES", 64 * 1024)
    monkeypatch.setattr(process_group, "KEPT_TAIL_BYTES", 16 * 1024)
    result = await run_shell(root, BIG)
    out = text(result)
    assert "though only its first 48.0 KiB and last 16.0 KiB: it was over 64.0 KiB" in out
    data = (root / result.details["output_file"]).read_bytes()
    marker = re.search(rb"\n\[agentloop: (\d+) bytes cut here: [^\]]*\]\n", data)
    assert marker is not None
    assert data[: marker.start()] == BIG_OUTPUT[: 48 * 1024]
    assert data[marker.end() :] == BIG_OUTPUT[-16 * 1024 :]
    assert int(marker[1]) == len(BIG_OUTPUT) - 64 * 1024


async def test_a_symlinked_output_directory_is_not_followed(root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "20200101-000000-00000000.txt").write_text("someone's file")  # (a name pruning would take)
    (root / ".agentloop").mkdir()
    (root / ".agentloop" / "outputs").symlink_to(elsewhere)
    result = await run_shell(root, BIG)
    out = text(result)
    assert "output_file" not in result.details and "the full output could not be kept" in out
    assert [p.name for p in elsewhere.iterdir()] == ["20200101-000000-00000000.txt"]


def _landlock() -> None:
    version, why = sandbox.landlock_status()
    if version >= 1:
        return
    if os.environ.get("AGENTLOOP_TEST_NO_LANDLOCK") == "1":
        pytest.skip(f"this machine has no Landlock ({why})")
    pytest.fail(f"Landlock is not available ({why})")


@pytest.mark.parametrize("mode", ["workspace", "private"])
async def test_a_sandboxed_commands_output_is_kept_and_a_private_command_can_read_it(root: Path, mode: str) -> None:
    _landlock()
    result = await run_shell(root, BIG, sandbox=mode)
    assert result.details["sandbox"] == mode
    name = result.details["output_file"]
    assert (root / name).read_bytes() == BIG_OUTPUT
    again = await run_shell(root, f"grep -n {MIDDLE} {name}", sandbox=mode)
    assert text(again) == f"150001:{MIDDLE}\n[exit code 0]"


async def test_the_default_policy_does_not_ask_to_read_a_kept_output(root: Path, tmp_path: Path) -> None:
    result = await run_shell(root, BIG)
    name = result.details["output_file"]
    home = tmp_path / "home"
    home.mkdir()
    args = {"path": name, "offset": 150000, "limit": 10}
    assert call_tags("fs.read", args, cwd=root, home=home) == {"hidden-path", "outside-home"}
    assert decide(default_policy(), "fs.read", args, cwd=root, home=home, root=root).action == "auto"
    # nor for a command that reads it, as a sandboxed one did above
    cmd = {"command": f"sed -n 150001p {name}"}
    assert decide(default_policy(), "shell.exec", cmd, cwd=root, home=home, root=root).action == "auto"


async def test_a_background_jobs_output_is_kept_and_named_while_it_runs_and_at_its_end(root: Path) -> None:
    rt = Runtime()
    try:
        job = await start(rt, root, f"{BIG}; read x")
        await until(lambda: rt.registry.of("p").find(job).bytes_so_far() == len(BIG_OUTPUT))
        middle = await output_of(rt, job, offset=1_000_000)
        name = rt.registry.of("p").find(job).kept_file()
        assert name is not None and f"the whole output so far is in {name}, which Read pages through" in middle
        await jobs(rt, action="input", job=job, text="")
        await rt.settle()
        [end] = rt.ends
        assert f"is kept in {name}: Read it with offset/limit" in end
        assert (root / name).read_bytes() == BIG_OUTPUT
    finally:
        for task in rt.tasks:
            task.cancel()
        await asyncio.gather(*rt.tasks, return_exceptions=True)
