"""Review of today's stream and transcriber changes (a985b37, 5d8ff6b):

- a follower of a process on the worker holding it (``Process.signals`` over a shared
  PostgreSQL) got a signal another worker logged for it (the queue change of a message sent
  there) only once the holder's next logged signal showed its seq skipped: while the run waited
  in a silent tool call (a long shell command, an approval), or the process was idle, it did not
  come at all, though the holder had heard of it at once; and the holder's stream deltas made
  after it reached the follower before it;
- a plain-def transcriber ran in the event loop's default executor: a few slow or stuck
  transcriptions (each past its timeout goes on in its thread) took every thread that executor
  has, and every other ``asyncio.to_thread`` of the kernel (file tools, archives, DNS lookups)
  waited behind them; and a stuck one kept the program from exiting (``asyncio.run`` waits for
  the default executor's threads, the interpreter for every executor's).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop import ScriptedModel
from agentloop.process import audio_video
from agentloop.process import signals as sig
from agentloop.process.audio_video import transcribe_audio
from agentloop.process.signals import Signal
from tests.process_support import gated
from tests.server_support import wait_until

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------ a follower on the holder


async def test_a_follower_on_the_holder_gets_a_forwarded_signal_while_the_run_waits_in_a_tool(
    pg_url: str, tmp_path: Path
) -> None:
    """A message sent through B while A's run waits in a silent tool call: B logs its queue
    change, A hears of it at once (a notification), and its follower gets it then, not when the
    tool (minutes later, maybe) ends; in seq order, once, with every logged signal."""
    pytest.importorskip("asyncpg", reason="the PostgreSQL store needs asyncpg (agentloop[postgres])")
    from tests.test_scale_out import kept_by, two

    gate = asyncio.Event()
    wait_gate, rm, brain, policy = gated(gate)
    async with two(pg_url, tmp_path, ScriptedModel(brain), [wait_gate, rm], approval=policy) as (a, b):
        on_a = await a.spawn(owner="alice")
        await kept_by(a, on_a.pid)
        stream = on_a.signals(follow=True)
        got: list[Signal] = []

        async def read() -> None:
            async for signal in stream:
                got.append(signal)
                if signal.signal == sig.RUN_FINISHED:
                    return

        reading = asyncio.ensure_future(read())
        try:
            await wait_until(lambda: a.engine.hub.watching(on_a.pid))
            await on_a.send("gate")  # the run waits in ``wait_gate`` until the gate opens
            await wait_until(lambda: any(s.signal == sig.TOOL_STARTED for s in got))
            before = await a.store.last_event_seq(on_a.pid)
            await (await b.process(on_a.pid)).send("and this", mode="queue")  # logged by B
            forwarded = await b.store.last_event_seq(on_a.pid)
            assert forwarded == before + 1
            # A hears of it within its poll (0.2 s here) at the latest: its follower with it
            await wait_until(lambda: any(s.seq == forwarded for s in got), 3)
            assert not gate.is_set() and not reading.done()
            gate.set()
            await asyncio.wait_for(reading, 10)
        finally:
            gate.set()
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            await stream.aclose()
        seqs = [s.seq for s in got if s.seq is not None]
        logged = [row.seq for row in await a.store.events(on_a.pid)]
        assert seqs == logged[: len(seqs)] and seqs == list(range(seqs[0], seqs[-1] + 1))


# ------------------------------------------------------------------ a plain-def transcriber's threads


class StuckTranscriber:
    """A plain-def transcriber that blocks until ``release`` is set (a local model that hangs, a
    blocking SDK call with no timeout of its own)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = 0

    def transcribe(self, audio: bytes, filename: str, mime: str) -> str:
        self.started += 1
        self.release.wait(30)
        return "late words"


@pytest.fixture
def stuck() -> Iterator[StuckTranscriber]:
    fake = StuckTranscriber()
    try:
        yield fake
    finally:
        fake.release.set()  # (the threads end with the test)


async def test_stuck_plain_def_transcriptions_leave_the_default_executor_free(stuck: StuckTranscriber) -> None:
    """As many stuck transcriptions as the default executor has threads (each given up at its
    timeout, each going on in its thread): the kernel's other ``to_thread`` work (file tools,
    archives, channel state) and its DNS lookups still run."""
    workers = min(32, (os.cpu_count() or 1) + 4)  # (ThreadPoolExecutor's default, which the loop's uses)
    for _ in range(workers + 2):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await transcribe_audio(stuck, b"OggS", "memo.ogg", "audio/ogg")
    assert await asyncio.wait_for(asyncio.to_thread(lambda: 42), 3) == 42
    loop = asyncio.get_running_loop()
    assert await asyncio.wait_for(loop.getaddrinfo("127.0.0.1", 80), 3)


async def test_a_stuck_transcription_keeps_the_others_from_starting_past_a_bound(stuck: StuckTranscriber) -> None:
    """Stuck ones hold threads of their own, so many at once: past ``TRANSCRIBER_THREADS`` a
    transcription waits for one to end (its own timeout counts meanwhile) instead of starting
    one more thread that may never end."""
    bound = audio_video.TRANSCRIBER_THREADS
    for _ in range(bound + 3):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await transcribe_audio(stuck, b"OggS", "memo.ogg", "audio/ogg")
    await asyncio.sleep(0.05)
    assert stuck.started == bound
    stuck.release.set()  # they end: the next one runs
    assert await asyncio.wait_for(transcribe_audio(stuck, b"OggS", "memo.ogg", "audio/ogg"), 3) == "late words"


def test_a_stuck_transcription_does_not_keep_the_program_from_exiting(tmp_path: Path) -> None:
    """Given up at its timeout, a transcription stuck in its thread must not hold the program
    (a server stopped, a script ending) for ever: ``asyncio.run`` waits for the default
    executor's threads, and the interpreter, at its exit, for every ``concurrent.futures`` one."""
    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, threading
            from agentloop.process.audio_video import transcribe_audio

            class Stuck:
                def transcribe(self, audio, filename, mime):
                    threading.Event().wait()  # never answers

            async def main():
                try:
                    async with asyncio.timeout(0.1):
                        await transcribe_audio(Stuck(), b"OggS", "memo.ogg", "audio/ogg")
                except TimeoutError:
                    print("gave up", flush=True)

            asyncio.run(main())
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=20, env=env)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the program did not exit: {exc.stdout!r}") from None
    assert done.returncode == 0 and done.stdout == "gave up\n", done
