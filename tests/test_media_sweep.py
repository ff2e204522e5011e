"""Media left behind by a process that is gone (a crash between a kill's delete and its file
removal, or between a spawn's files and its commit) is removed when the runtime next opens; the
media of live processes, and a directory too young to judge, stay."""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

from agentloop import ScriptedModel
from agentloop.messages import ImageContent
from agentloop.process.media import ORPHAN_AGE
from tests.image_support import PNG
from tests.process_support import kernel


def _age(directory: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(directory, (then, then))


async def test_media_of_processes_that_are_gone_is_removed_at_the_next_open(tmp_path: Path) -> None:
    image = ImageContent(data=base64.b64encode(PNG).decode(), mime_type="image/png")
    async with kernel(tmp_path, ScriptedModel(lambda request: "seen")) as k:
        kept = await k.spawn(owner="alice", text="look", media=[image])
        await kept.wait_idle()
    media = tmp_path / "var" / "media" / "alice"
    live = media / kept.pid
    assert any(live.iterdir())
    crashed = media / "6612af2cf47effa92b8"  # a kill that crashed after the delete: its files remain
    crashed.mkdir()
    (crashed / "x.png").write_bytes(PNG)
    young = media / "6612af2cf47effa92b9"  # a spawn another worker is making right now
    young.mkdir()
    (young / "y.png").write_bytes(PNG)
    for directory in (live, crashed):
        _age(directory, ORPHAN_AGE + 60)
    _age(young, 5)
    async with kernel(tmp_path, ScriptedModel(lambda request: "seen")) as k:
        assert len(await k.processes(owner="alice")) == 1
    assert not crashed.exists()
    assert any(live.iterdir()) and any(young.iterdir())


async def test_a_stray_name_in_the_media_folder_does_not_stop_the_runtime(tmp_path: Path) -> None:
    odd = tmp_path / "var" / "media" / "alice" / "..hidden"
    odd.mkdir(parents=True)
    (tmp_path / "var" / "media" / "stray-file").write_text("not a folder")
    _age(odd, ORPHAN_AGE + 60)
    async with kernel(tmp_path, ScriptedModel(lambda request: "seen")) as k:
        proc = await k.spawn(owner="alice", text="hi")
        await proc.wait_idle()
    assert odd.exists()  # not a name a process could have: left to the person who put it there
