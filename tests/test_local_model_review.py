"""Review findings for the embedded model: usage after retries, and sharing the model cache
between processes. Fake ``Llama`` and fake part packages only: no weights are needed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentloop.events import StreamDone
from agentloop.messages import user
from agentloop.models import gguf_assets
from agentloop.models.local import LocalModel
from agentloop.models.overflow import is_context_overflow
from tests.test_local_protocol import READ, FakeLlama, call_msg, request, result_msg, run


class BigPromptLlama(FakeLlama):
    """A fake whose prompts fill most of the window, as a long tool result does."""

    def _chunks(self, reply: str) -> Iterator[dict[str, Any]]:
        for chunk in super()._chunks(reply):
            if chunk["choices"][0].get("finish_reason") == "stop":
                self.n_tokens = 5_000 + len(range(0, len(reply), 3))
            yield chunk


async def test_a_retried_reply_does_not_read_as_a_context_overflow() -> None:
    """The repeated-call guard asks the model twice. Each prompt fits the window, so the reply
    must not report their sum as its input: the driver would take that for a silent overflow,
    throw the good answer away, compact and ask again (minutes on a CPU)."""
    fake = BigPromptLlama(
        '{"tool": "read_file", "arguments": {"path": "a.txt"}}',
        '{"final_answer": "done"}',
    )
    m = LocalModel("qwen2.5-coder-0.5b", llama=fake, n_ctx=8192)
    history = [user("read a.txt"), call_msg("read_file", {"path": "a.txt"}), result_msg("read_file", "x" * 100)]
    _, last = await run(m, request(*history, tools=[READ]))
    assert isinstance(last, StreamDone) and last.message.text == "done"
    assert len(fake.calls) == 2
    usage = last.message.usage
    assert 0 < usage.input <= 8192
    assert usage.output > 0
    assert not is_context_overflow(last.message, m.info.context_window)


# ------------------------------------------------------------------ the model cache across processes

PARTS = [b"GGUF" + b"a" * 3000, b"b" * 2500, b"c" * 17]
WHOLE = b"".join(PARTS)

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    from agentloop.models import gguf_assets
    from agentloop.models.gguf_assets import KnownModel, ensure_model_file

    cfg = json.loads(sys.argv[1])
    gguf_assets.KNOWN_MODELS["fake-model"] = KnownModel(
        "fake-model", cfg["prefix"], "fake-model-part", 3, "1.0", cfg["sha"], cfg["size"], 1, "local-small"
    )
    gguf_assets._CHUNK = 64  # small reads, each slowed below: the copy takes a while, as a real one does
    lines = []

    def progress(line):
        lines.append(line)
        time.sleep(0.02)

    gguf_assets._REPORT_EVERY = 64
    open(cfg["ready"] + sys.argv[2], "w").close()
    while not all(__import__("os").path.exists(cfg["ready"] + n) for n in "AB"):
        time.sleep(0.005)
    path = ensure_model_file("fake-model", progress)
    ok = open(path, "rb").read() == cfg["whole"].encode("latin-1")
    print(json.dumps({"assembled": any(l.startswith("assembling") for l in lines), "ok": ok}))
    """
)


def test_two_processes_share_one_assembly(tmp_path: Path) -> None:
    """Two agentloop processes started together (a server and a CLI, say) must not both copy
    the gigabyte: the second waits for the first and uses its verified file."""
    prefix = f"agentloop_review_{tmp_path.name.replace('-', '_')}_part"
    site = tmp_path / "site"
    for i, data in enumerate(PARTS, start=1):
        (site / f"{prefix}{i}" / "data").mkdir(parents=True)
        (site / f"{prefix}{i}" / "__init__.py").write_text("")
        (site / f"{prefix}{i}" / "data" / f"part{i:02d}.bin").write_bytes(data)
    cfg = {
        "prefix": prefix,
        "sha": hashlib.sha256(WHOLE).hexdigest(),
        "size": len(WHOLE),
        "ready": str(tmp_path / "ready-"),
        "whole": WHOLE.decode("latin-1"),
    }
    env = {
        **os.environ,
        "AGENTLOOP_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(site), *sys.path]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(cfg), name], env=env, stdout=subprocess.PIPE, text=True
        )
        for name in "AB"
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["ok"] for r in results)
    assert sum(r["assembled"] for r in results) == 1, results
    cache = tmp_path / "cache" / "models"
    assert not [p for p in cache.iterdir() if p.name.endswith((".part", ".tmp"))]


def test_marker_writes_do_not_collide(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker's temporary file must be private to its writer: with a shared name, a second
    writer's rename takes the file from under the first, whose own rename then fails."""
    target = tmp_path / "m.gguf"
    target.write_bytes(b"GGUF")
    real_replace = os.replace
    nested = {"done": False}

    def replace(src: Any, dst: Any) -> None:
        if not nested["done"] and str(dst).endswith(".sha256"):
            nested["done"] = True
            gguf_assets._write_marker(target, "0" * 64)  # another writer, between our write and rename
        real_replace(src, dst)

    monkeypatch.setattr(gguf_assets.os, "replace", replace)
    gguf_assets._write_marker(target, "0" * 64)
    assert gguf_assets._marker_matches(target, "0" * 64)
