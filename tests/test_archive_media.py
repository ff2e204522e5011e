"""History archives and the media store: lossless, atomic, and closed to path tricks."""

from __future__ import annotations

import base64
import gzip
import json
import os
from pathlib import Path
from typing import Any

import pytest

from agentloop.messages import (
    AssistantMessage,
    Cost,
    ImageContent,
    Message,
    SystemMessage,
    TextContent,
    ThinkingContent,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserMessage,
)
from agentloop.process.archive import list_archives, read_archive, write_archive
from agentloop.process.media import MediaError, MediaNotFound, MediaRef, MediaStore, MediaTooLarge
from tests.image_support import GIF, JPEG, PNG, WEBP


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def every_kind() -> list[Message]:
    call_a = ToolCall(id="toolu_1", name="read", arguments={"path": "a.py", "lines": [1, 2], "opts": {"x": None}})
    call_b = ToolCall(id="toolu_2", name="shell", arguments={})
    return [
        SystemMessage(content=[TextContent(text="earlier summary")], kind="summary"),
        UserMessage(content=[TextContent(text="look at this ✓"), ImageContent(data=b64(PNG), mime_type="image/png")]),
        AssistantMessage(
            content=[
                ThinkingContent(thinking="hmm", signature="sig=="),
                ThinkingContent(thinking="", redacted=True),
                TextContent(text="reading both"),
                call_a,
                call_b,
            ],
            provider="anthropic",
            model="claude",
            usage=Usage(input=10, output=5, cache_read=3, cache_write=2, total_tokens=20, cost=Cost(total=0.5)),
            stop_reason="toolUse",
        ),
        ToolResultMessage(
            tool_call_id="toolu_1",
            tool_name="read",
            content=[TextContent(text="print(1)"), ImageContent(data=b64(JPEG), mime_type="image/jpeg")],
            details={"bytes": 8, "nested": [1, {"a": True}]},
        ),
        ToolResultMessage(tool_call_id="toolu_2", tool_name="shell", content=[TextContent(text="boom")], is_error=True),
        AssistantMessage(content=[], stop_reason="error", error_message="overloaded"),
        SystemMessage(content=[TextContent(text="steered")], kind="event"),
    ]


# ------------------------------------------------------------------ archives


def test_archive_round_trip_is_lossless(tmp_path: Path) -> None:
    msgs = every_kind()
    meta = {"reason": "reset", "generation": 3, "note": "ünïcode"}
    path = write_archive(tmp_path, "alice", "p-1", "seg-0001", msgs, meta)
    assert path == tmp_path / "var" / "sessions" / "alice" / "p-1" / "seg-0001.jsonl.gz"
    header, back = read_archive(path)
    assert back == msgs
    assert header["meta"] == meta
    assert header["count"] == len(msgs) and header["pid"] == "p-1" and header["user"] == "alice"
    # the format is plain gzip JSONL: a header line, then one message per line
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    assert len(lines) == 1 + len(msgs)
    assert json.loads(lines[2])["role"] == "user"


def test_empty_archive_and_no_meta(tmp_path: Path) -> None:
    header, back = read_archive(write_archive(tmp_path, "u", "p", "empty", []))
    assert back == [] and header["meta"] == {}


def test_writes_are_atomic_and_leave_no_temp_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_archive(tmp_path, "u", "p", "one", every_kind())
    folder = tmp_path / "var" / "sessions" / "u" / "p"
    assert sorted(p.name for p in folder.iterdir()) == ["one.jsonl.gz"]

    def crash(*args: Any) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "link", crash)  # (publishing falls back to a rename without hard links)
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        write_archive(tmp_path, "u", "p", "two", every_kind())
    assert sorted(p.name for p in folder.iterdir()) == ["one.jsonl.gz"]


def test_existing_archive_is_never_overwritten(tmp_path: Path) -> None:
    msgs = every_kind()
    write_archive(tmp_path, "u", "p", "seg", msgs)
    with pytest.raises(FileExistsError):
        write_archive(tmp_path, "u", "p", "seg", [])
    assert read_archive(tmp_path / "var/sessions/u/p/seg.jsonl.gz")[1] == msgs


def test_unserialisable_meta_is_refused_without_a_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="meta"):
        write_archive(tmp_path, "u", "p", "seg", [], {"when": object()})
    assert list_archives(tmp_path, "u", "p") == []


@pytest.mark.parametrize(
    "bad", ["", "..", ".", "../x", "a/b", "a\\b", "a..b", ".hidden", "x\x00", "a b", "é", "x" * 129]
)
def test_bad_names_users_and_pids_are_refused(tmp_path: Path, bad: str) -> None:
    for args in [("u", "p", bad), ("u", bad, "n"), (bad, "p", "n")]:
        with pytest.raises(ValueError):
            write_archive(tmp_path, *args, [])
    assert not (tmp_path / "var").exists() or not any((tmp_path / "var").rglob("*.gz"))


def test_list_archives_oldest_first(tmp_path: Path) -> None:
    assert list_archives(tmp_path, "u", "p") == []
    for name in ["zeta", "alpha", "mid", "reset.gen-1"]:
        write_archive(tmp_path, "u", "p", name, [])
    (tmp_path / "var/sessions/u/p/.zz.tmp").write_bytes(b"junk")  # a crashed writer's leftovers
    assert [p.name for p in list_archives(tmp_path, "u", "p")] == [
        "zeta.jsonl.gz",
        "alpha.jsonl.gz",
        "mid.jsonl.gz",
        "reset.gen-1.jsonl.gz",
    ]


def test_truncated_or_foreign_archives_are_detected(tmp_path: Path) -> None:
    path = write_archive(tmp_path, "u", "p", "seg", every_kind())
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(("\n".join(lines[:-2]) + "\n").encode()))
    with pytest.raises(ValueError, match="header says"):
        read_archive(cut)
    foreign = tmp_path / "foreign.jsonl.gz"
    foreign.write_bytes(gzip.compress(b'{"role": "user"}\n'))
    with pytest.raises(ValueError, match="header"):
        read_archive(foreign)
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError):
        read_archive(broken)


# ------------------------------------------------------------------ media


@pytest.mark.parametrize(
    ("data", "mime", "ext"),
    [(PNG, "image/png", "png"), (JPEG, "image/jpeg", "jpg"), (GIF, "image/gif", "gif"), (WEBP, "image/webp", "webp")],
)
def test_media_save_and_load(tmp_path: Path, data: bytes, mime: str, ext: str) -> None:
    store = MediaStore(tmp_path)
    image = ImageContent(data=b64(data), mime_type=mime)
    ref = store.save("1000", "p-1", image)
    assert ref.path == f"var/media/1000/p-1/{ref.sha256}.{ext}"
    assert (tmp_path / ref.path).read_bytes() == data
    assert ref.size == len(data) and ref.mime_type == mime
    assert store.load(ref) == image


def test_media_dedupes_by_content_per_process(tmp_path: Path) -> None:
    store = MediaStore(tmp_path)
    a = store.save("u", "p", ImageContent(data=b64(PNG), mime_type="image/png"))
    b = store.save("u", "p", ImageContent(data=b64(PNG), mime_type="image/png"))
    c = store.save("u", "q", ImageContent(data=b64(PNG), mime_type="image/png"))
    assert a == b and a.path != c.path and a.sha256 == c.sha256
    assert len(list((tmp_path / "var/media/u/p").iterdir())) == 1


def test_media_ref_serialises(tmp_path: Path) -> None:
    ref = MediaStore(tmp_path).save("u", "p", ImageContent(data=b64(GIF), mime_type="image/gif"))
    assert MediaRef.from_dict(json.loads(json.dumps(ref.to_dict()))) == ref
    for bad in [
        None,
        {},
        {**ref.to_dict(), "size": -1},
        {**ref.to_dict(), "sha256": "nope"},
        {**ref.to_dict(), "size": True},
    ]:
        with pytest.raises(MediaError):
            MediaRef.from_dict(bad)


def test_mislabelled_unknown_and_garbled_images_are_refused(tmp_path: Path) -> None:
    store = MediaStore(tmp_path)
    with pytest.raises(MediaError, match="its bytes are image/png"):
        store.save("u", "p", ImageContent(data=b64(PNG), mime_type="image/jpeg"))
    with pytest.raises(MediaError, match="not a PNG"):
        store.save("u", "p", ImageContent(data=b64(b"<svg></svg>"), mime_type="image/png"))
    with pytest.raises(MediaError, match="unsupported"):
        store.save("u", "p", ImageContent(data=b64(PNG), mime_type="image/svg+xml"))
    with pytest.raises(MediaError, match="base64"):
        store.save("u", "p", ImageContent(data="!!not base64!!", mime_type="image/png"))
    assert not (tmp_path / "var/media/u/p").exists() or not list((tmp_path / "var/media/u/p").iterdir())


def test_jpg_alias_is_normalised(tmp_path: Path) -> None:
    ref = MediaStore(tmp_path).save("u", "p", ImageContent(data=b64(JPEG), mime_type="image/JPG"))
    assert ref.mime_type == "image/jpeg"


def test_size_limit(tmp_path: Path) -> None:
    store = MediaStore(tmp_path, max_bytes=len(PNG))
    store.save("u", "p", ImageContent(data=b64(PNG), mime_type="image/png"))
    bigger = PNG + b"\x00"
    with pytest.raises(MediaTooLarge, match="limit"):
        store.save("u", "p", ImageContent(data=b64(bigger), mime_type="image/png"))
    with pytest.raises(MediaTooLarge):
        store.save("u", "p", ImageContent(data=b64(PNG + bytes(10_000)), mime_type="image/png"))


def test_missing_corrupt_and_escaping_refs(tmp_path: Path) -> None:
    store = MediaStore(tmp_path)
    ref = store.save("u", "p", ImageContent(data=b64(PNG), mime_type="image/png"))
    (tmp_path / ref.path).write_bytes(PNG + b"tampered")
    with pytest.raises(MediaError, match="corrupt"):
        store.load(ref)
    (tmp_path / ref.path).unlink()
    with pytest.raises(MediaNotFound) as info:
        store.load(ref)
    assert ref.path in str(info.value) and ref.sha256 in str(info.value)
    for path in ["var/media/../../etc/passwd", "/etc/passwd", "var/sessions/u/p/x.png"]:
        with pytest.raises(MediaError, match="outside"):
            store.load(MediaRef(path=path, mime_type="image/png", size=1, sha256=ref.sha256))


def test_delete_process_removes_only_that_process(tmp_path: Path) -> None:
    store = MediaStore(tmp_path)
    for data, mime in [(PNG, "image/png"), (JPEG, "image/jpeg"), (GIF, "image/gif")]:
        store.save("u", "p", ImageContent(data=b64(data), mime_type=mime))
    other = store.save("u", "q", ImageContent(data=b64(PNG), mime_type="image/png"))
    assert store.delete_process("u", "p") == 3
    assert not (tmp_path / "var/media/u/p").exists()
    assert store.delete_process("u", "p") == 0
    assert store.load(other).mime_type == "image/png"
    with pytest.raises(ValueError):
        store.delete_process("u", "..")
    with pytest.raises(ValueError):
        store.save("../u", "p", ImageContent(data=b64(PNG), mime_type="image/png"))


def test_media_writes_leave_no_temp_files(tmp_path: Path) -> None:
    store = MediaStore(tmp_path)
    store.save("u", "p", ImageContent(data=b64(PNG), mime_type="image/png"))
    names = os.listdir(tmp_path / "var/media/u/p")
    assert len(names) == 1 and not names[0].startswith(".")


async def test_a_send_with_one_bad_image_stores_no_image_and_no_message(tmp_path: Path) -> None:
    from agentloop import Kernel, ScriptedModel

    good = ImageContent(data=base64.b64encode(PNG).decode(), mime_type="image/png")
    bad = ImageContent(data=base64.b64encode(b"hello").decode(), mime_type="image/png")
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=ScriptedModel(["x"]), workspace=tmp_path) as k:
        proc = await k.spawn(owner="ann")
        with pytest.raises(MediaError, match="not a PNG"):
            await proc.send("look", media=[good, bad])
        assert not (tmp_path / "var" / "media").exists() or not any((tmp_path / "var" / "media").rglob("*.png"))
        assert await proc.messages() == []
