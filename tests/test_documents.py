"""Documents attached to user input (``FileContent``: PDF, plain text, Markdown, CSV): the message
format, storage as media files with their content checked, the model seeing the document back,
the local model getting text documents as text, and what compaction counts and shows."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentloop import FileContent, ScriptedModel, UserMessage, user
from agentloop.kernel import Kernel
from agentloop.messages import document_text, message_from_json, message_to_json
from agentloop.models.base import file_text
from agentloop.models.local import chat_messages
from agentloop.process.compaction import IMAGE_TOKENS, estimate_tokens, render_transcript
from agentloop.process.media import (
    MAX_TEXT_BYTES,
    MEDIA_PREFIX,
    MediaError,
    MediaRef,
    MediaStore,
    MediaTooLarge,
    is_stored,
)

PDF_BYTES = b"%PDF-1.4\n" + b"0" * 4000 + b"\n%%EOF\n"
PDF = FileContent(data=base64.b64encode(PDF_BYTES).decode(), mime_type="application/pdf", name="report.pdf")
NOTES = FileContent(data=base64.b64encode(b"# Plan\nship it").decode(), mime_type="text/markdown", name="plan.md")


def test_a_document_round_trips_and_text_ones_read_as_text() -> None:
    msg = user("read these", PDF, NOTES)
    assert message_from_json(message_to_json(msg)) == msg
    assert '"type":"file"' in message_to_json(msg) and '"mimeType":"application/pdf"' in message_to_json(msg)
    assert document_text(NOTES) == "# Plan\nship it" and document_text(PDF) is None
    assert file_text(NOTES) == '<file name="plan.md" type="text/markdown">\n# Plan\nship it\n</file>'
    garbled = FileContent(data="not base64!", mime_type="text/plain")
    assert document_text(garbled) is None


def test_the_local_model_reads_text_documents_and_is_told_of_a_pdf() -> None:
    [turn] = chat_messages("", [user("read these", PDF, NOTES)], json_protocol=False)
    assert "# Plan\nship it" in turn["content"]
    assert "[report.pdf omitted: this local model cannot read PDFs]" in turn["content"]


def test_compaction_counts_documents_by_size_and_names_them() -> None:
    small = FileContent(data=base64.b64encode(b"x" * 400).decode(), mime_type="text/plain", name="a.txt")
    assert estimate_tokens(user("", small)) > estimate_tokens(user(""))
    assert estimate_tokens(user("", small)) - estimate_tokens(user("")) == 100  # 400 characters
    assert estimate_tokens(user("", PDF)) - estimate_tokens(user("")) == IMAGE_TOKENS  # a small PDF: the floor
    assert "[file report.pdf (application/pdf)]" in render_transcript([user("read", PDF)])


@pytest.mark.parametrize(
    ("block", "why"),
    [
        (FileContent(data=base64.b64encode(b"PK\x03\x04").decode(), mime_type="application/pdf"), "is not a PDF"),
        (FileContent(data=base64.b64encode(b"a\x00b").decode(), mime_type="text/csv"), "NUL bytes"),
        (FileContent(data=base64.b64encode(b"\xff\xfe").decode(), mime_type="text/plain"), "not UTF-8"),
        (FileContent(data="%%%", mime_type="text/plain"), "not valid base64"),
    ],
    ids=["not-a-pdf", "nul", "not-utf8", "bad-base64"],
)
def test_documents_that_are_not_what_they_say_are_refused(tmp_path: Path, block: FileContent, why: str) -> None:
    with pytest.raises(MediaError, match=why):
        MediaStore(tmp_path).check(block)


def test_a_document_of_an_unknown_type_is_refused_when_it_is_built() -> None:
    """Not only where media is stored: an in-memory Agent hands blocks straight to the adapters."""
    with pytest.raises(ValueError, match="unsupported document type 'application/zip'"):
        FileContent(data=base64.b64encode(b"PK").decode(), mime_type="application/zip")
    with pytest.raises(ValidationError, match="unsupported document type"):
        message_from_json('{"role":"user","content":[{"type":"file","data":"","mimeType":"image/png"}],"timestamp":1}')
    assert FileContent(data="", mime_type=" Text/X-Markdown").mime_type == "text/markdown"


def test_a_text_document_has_a_smaller_limit_than_a_pdf(tmp_path: Path) -> None:
    """A text document reaches the model whole: a big one would crowd out the conversation."""
    big = FileContent(data=base64.b64encode(b"x" * (MAX_TEXT_BYTES + 1)).decode(), mime_type="text/plain")
    with pytest.raises(MediaTooLarge, match="text document"):
        MediaStore(tmp_path).check(big)
    pdf = b"%PDF-1.4\n" + b"0" * (MAX_TEXT_BYTES + 1)
    MediaStore(tmp_path).check(FileContent(data=base64.b64encode(pdf).decode(), mime_type="application/pdf"))


def test_a_stored_document_counts_by_the_size_its_reference_gives(tmp_path: Path) -> None:
    text = FileContent(data=base64.b64encode(b"x" * 400).decode(), mime_type="text/plain", name="a.txt")
    ref = MediaStore(tmp_path).save("alice", "p1", text)
    stored = FileContent(data=ref.to_data(), mime_type="text/plain", name="a.txt")
    assert is_stored(stored) and not is_stored(text) and MediaRef.of(stored) == ref
    assert estimate_tokens(user("", stored)) - estimate_tokens(user("")) == 100  # 400 bytes, as inline
    broken = FileContent(data=MEDIA_PREFIX + "{not json", mime_type="text/plain")
    with pytest.raises(MediaError):
        MediaRef.of(broken)
    assert estimate_tokens(user("", broken)) == estimate_tokens(user(""))  # counted as empty, not a crash


def test_a_stored_document_comes_back_with_its_name(tmp_path: Path) -> None:
    store = MediaStore(tmp_path)
    ref = store.save("alice", "p1", NOTES)
    assert ref.path.endswith(".md") and ref.mime_type == "text/markdown"
    assert store.load(ref, "plan.md") == NOTES


async def test_documents_sent_to_a_process_are_stored_as_files_and_reach_the_model(tmp_path: Path) -> None:
    model = ScriptedModel(["read them"])
    async with Kernel.open(f"sqlite:///{tmp_path}/a.db", model=model, workspace=tmp_path, tools=[]) as k:
        proc = await k.spawn(owner="alice")
        await proc.send("summarise", media=[PDF, NOTES])
        await proc.wait_idle()
        sent = model.requests[0].messages[0]
        assert isinstance(sent, UserMessage) and sent.content[1:] == [PDF, NOTES]  # the documents themselves
        stored = (await proc.messages())[0]
        assert isinstance(stored, UserMessage)
        assert [b.data.startswith("media:") for b in stored.content[1:]] == [True, True]  # references only
        assert [getattr(b, "name", None) for b in stored.content[1:]] == ["report.pdf", "plan.md"]
        files = sorted(p.suffix for p in (tmp_path / "var" / "media" / "alice" / proc.pid).iterdir())
        assert files == [".md", ".pdf"]
        await proc.kill()
        assert not (tmp_path / "var" / "media" / "alice" / proc.pid).exists()  # deleted with the process
