"""Review of ``agentloop serve`` hosting the chat bridges and of the per-run path checks
(``kernel/runs.path_stats``): a signal while a bridge starts, a bridge whose wait fails, a witness
dropped by another thread, and a directory trusted only once its timestamp had settled before its
missing entry was looked up."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import threading
import time
import types
from pathlib import Path

import pytest

from agentloop.cli.approvals import parse_approval
from agentloop.cli.channel import Bridge, HostedBridge
from agentloop.cli.config import Settings
from agentloop.cli.main import CliError
from agentloop.cli.serve import ServeOptions, serve_async
from agentloop.kernel import Kernel, runs
from agentloop.kernel.runs import path_stats


def _opts(tmp_path: Path, start: object) -> tuple[ServeOptions, io.StringIO]:
    out = io.StringIO()
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["never asked"]))
    settings = Settings(model=f"scripted:{script}", model_source="test")
    root = tmp_path.resolve()
    opts = ServeOptions("127.0.0.1", 0, root, root, settings, parse_approval("ask"), out=out)
    opts.bridges = [HostedBridge("discord", start)]  # type: ignore[arg-type]
    return opts, out


def test_a_signal_while_a_bridge_starts_ends_its_start_and_serve(tmp_path: Path) -> None:
    """A bridge's start may wait long (Discord waits 30 s for its gateway, an unreachable API is
    tried again): SIGTERM meanwhile stopped nothing until it was done. Now it ends the start (the
    bridge closes itself, as on any failure) and serve, without ever serving."""
    assert threading.current_thread() is threading.main_thread()
    ended: list[str] = []

    async def start(kernel: Kernel, settings: Settings) -> tuple[Bridge, str]:
        # (serve's own handler is installed by now: the signal cannot reach pytest's default one)
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            await asyncio.sleep(3600)  # (a gateway that never answers)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise
        raise AssertionError("not reached")

    opts, out = _opts(tmp_path, start)
    began = time.monotonic()
    asyncio.run(asyncio.wait_for(serve_async(opts), 8))
    assert time.monotonic() - began < 8
    assert ended == ["cancelled"]
    assert "agentloop serving on" not in out.getvalue()
    # sse-starlette's process-wide "shutting down" flag, which the signal set, is cleared once serve
    # is over: left set, every event stream of a server started later in this process was cut
    from sse_starlette.sse import AppStatus

    assert AppStatus.should_exit is False


class _Failing:
    """A bridge whose wait fails (a bug in it): it no longer runs."""

    async def wait(self) -> None:
        await asyncio.sleep(0.1)
        raise RuntimeError("https://api.telegram.org/bot4242:secret/getUpdates broke")

    async def close(self) -> None:
        pass


def test_a_bridge_whose_wait_fails_stops_serve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its watcher died with it, and serve went on without the bridge, exit 0 at the end; now it
    stops serve as a bridge that ends does, naming the failure's kind only (never its text)."""

    async def start(kernel: Kernel, settings: Settings) -> tuple[Bridge, str]:
        return _Failing(), "listening"

    opts, out = _opts(tmp_path, start)
    with pytest.raises(CliError, match="the discord bridge stopped"):
        asyncio.run(asyncio.wait_for(serve_async(opts, signals=False), 8))
    assert "agentloop serving on" in out.getvalue()
    err = capsys.readouterr().err
    assert "the discord bridge stopped (RuntimeError), so serve stops" in err and "secret" not in err


OLD_NS = time.time_ns() - 3_600 * 10**9 + 123_457  # an hour ago: settled (not on a whole millisecond)


@pytest.fixture
def _fresh_witnesses() -> None:
    runs._absent.clear()


@pytest.mark.usefixtures("_fresh_witnesses")
def test_a_witness_dropped_by_another_thread_meanwhile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The witnesses are shared by every thread (toolsets of kernels on other threads): one that
    another thread drops (evicted at 4096) while this one finds it stale raised KeyError, and the
    run's prompt was not built."""
    target = tmp_path / "context.d"
    os.utime(tmp_path, ns=(OLD_NS, OLD_NS))
    assert path_stats([str(target)]) == [None]
    assert str(target) in runs._absent
    target.mkdir()  # (its directory's time changes: the witness is stale)
    real = os.stat

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if path == str(tmp_path):
            runs._absent.clear()  # (what another thread's eviction does, between a lookup and its drop)
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runs.os, "stat", stat)
    [found] = path_stats([str(target)])
    assert found is not None


@pytest.mark.usefixtures("_fresh_witnesses")
def test_a_directory_is_trusted_only_if_settled_before_its_entry_was_looked_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry made right after its lookup, within the directory's timestamp granule, leaves the
    directory's time as it was: the clock read to judge that granule over must be one taken before
    the lookup. Read after it (the thread preempted in between), the witness was trusted and the
    new entry never seen."""
    where = tmp_path / "d"
    where.mkdir()
    target = where / "context.d"
    mtime = os.stat(where).st_mtime_ns
    looked: list[str] = []
    real_lstat = os.lstat

    def lstat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        try:
            return real_lstat(path, *args, **kwargs)  # type: ignore[arg-type]
        except FileNotFoundError:
            if path == str(target) and not looked:
                looked.append(str(path))
                target.mkdir()  # (made just after it was found absent, in the same granule)
                os.utime(where, ns=(mtime, mtime))
            raise

    def time_ns() -> int:  # (before the lookup the granule is current; after it, long over)
        return mtime + (10 * 10**9 if looked else 10_000_000)

    monkeypatch.setattr(runs.os, "lstat", lstat)
    monkeypatch.setattr(runs, "time", types.SimpleNamespace(time_ns=time_ns))
    assert path_stats([str(target)]) == [None]
    assert looked == [str(target)]
    [found] = path_stats([str(target)])
    assert found is not None


@pytest.mark.parametrize("given", ["flag", "config file"])
def test_a_token_put_among_a_bridges_options_is_not_quoted_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    """The token belongs in the environment; put among the options by mistake (the config file's
    ``[bridges]`` most of all, whose values are promised never to be quoted back), the parser's
    refusal quoted it on stderr, which a service's log keeps."""
    from typer.testing import CliRunner

    from agentloop.cli.main import app

    config = tmp_path / "config.toml"
    monkeypatch.setenv("AGENTLOOP_CONFIG", str(config))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    for name in ("AGENTLOOP_MODEL", "AGENTLOOP_DEBUG", "AGENTLOOP_DATA", "AGENTLOOP_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "4242:AAE-env_token_0123456789abcdef")
    secret = "4242:AAE-pasted_token_0123456789abcdef"
    args = ["serve", "--port", "0", "--data", str(tmp_path / "data"), "-w", str(tmp_path)]
    for options, said in ((f"--allow 1 {secret}", "unexpected extra argument"), (f"--allow {secret}", "--allow")):
        if given == "flag":
            result = CliRunner().invoke(app, [*args, "--telegram", options])
        else:
            config.write_text(f"[bridges]\ntelegram = {json.dumps(options)}\n")
            result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.stderr
        assert "error: --telegram: " in result.stderr and said in result.stderr
        assert "pasted_token" not in result.stdout + result.stderr
