"""Assembling the embedded model's GGUF from PyPI parts, with fake part packages on ``sys.path``."""

from __future__ import annotations

import hashlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop.models import gguf_assets
from agentloop.models.base import ProviderError
from agentloop.models.gguf_assets import KnownModel, ensure_model_file, local_model_status

PARTS = [b"GGUF" + b"a" * 3000, b"b" * 2500, b"c" * 17]
WHOLE = b"".join(PARTS)


def _make_parts(root: Path, prefix: str, parts: list[bytes]) -> None:
    for i, data in enumerate(parts, start=1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('part packages must not be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)


@pytest.fixture
def fake_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KnownModel]:
    prefix = f"agentloop_fake_{tmp_path.name.replace('-', '_')}_part"
    site = tmp_path / "site"
    _make_parts(site, prefix, PARTS)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    known = KnownModel(
        id="fake-model",
        module_prefix=prefix,
        package_prefix="fake-model-part",
        parts=len(PARTS),
        version="1.0",
        sha256=hashlib.sha256(WHOLE).hexdigest(),
        size=len(WHOLE),
        approx_mb=1,
        extra="local-small",
    )
    monkeypatch.setitem(gguf_assets.KNOWN_MODELS, known.id, known)
    monkeypatch.setenv("AGENTLOOP_CACHE", str(tmp_path / "cache"))
    yield known
    for name in [m for m in sys.modules if m.startswith(prefix)]:
        del sys.modules[name]


def _site(known: KnownModel) -> Path:
    spec = importlib.util.find_spec(known.module(1))
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))).parent


def test_assembles_once_and_verifies(fake_model: KnownModel, tmp_path: Path) -> None:
    lines: list[str] = []
    path = ensure_model_file("local:fake-model", lines.append)
    assert path == tmp_path / "cache" / "models" / "fake-model.gguf"
    assert path.read_bytes() == WHOLE
    assert any(line.startswith("assembling fake-model:") for line in lines)
    assert path.with_name(path.name + ".sha256").is_file()
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".part")]
    assert not any(m.startswith(fake_model.module_prefix) for m in sys.modules)  # never imported


def test_marker_skips_hashing_on_later_starts(fake_model: KnownModel, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ensure_model_file("fake-model")

    def no_hash(*args: object) -> str:
        raise AssertionError("a verified cache file must not be hashed again")

    monkeypatch.setattr(gguf_assets, "_hash_file", no_hash)
    monkeypatch.setattr(gguf_assets, "_assemble", no_hash)
    assert ensure_model_file("fake-model") == path


def test_unmarked_but_good_cache_is_hashed_and_kept(fake_model: KnownModel) -> None:
    path = ensure_model_file("fake-model")
    path.with_name(path.name + ".sha256").unlink()
    lines: list[str] = []
    assert ensure_model_file("fake-model", lines.append) == path
    assert lines and all(line.startswith("verifying") for line in lines)
    assert path.with_name(path.name + ".sha256").is_file()


def test_corrupt_cache_is_rebuilt(fake_model: KnownModel) -> None:
    path = ensure_model_file("fake-model")
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF  # same size, different content: only the hash can tell
    path.write_bytes(bytes(data))
    lines: list[str] = []
    assert ensure_model_file("fake-model", lines.append) == path
    assert path.read_bytes() == WHOLE
    assert any("damaged" in line for line in lines)


def test_truncated_cache_is_rebuilt(fake_model: KnownModel) -> None:
    path = ensure_model_file("fake-model")
    path.write_bytes(WHOLE[:10])
    assert ensure_model_file("fake-model").read_bytes() == WHOLE


def test_missing_parts_say_what_to_install(fake_model: KnownModel) -> None:
    part2 = _site(fake_model) / f"{fake_model.module_prefix}2"
    (part2 / "data" / "part02.bin").unlink()
    with pytest.raises(ProviderError) as err:
        ensure_model_file("fake-model")
    assert err.value.kind == "bad_request"
    message = str(err.value)
    assert "pip install 'agentloop[local-small]'" in message
    assert "fake-model-part2==1.0" in message
    assert "fake-model-part1==1.0" not in message
    assert not (gguf_assets.cache_path("fake-model")).exists()


def test_known_model_without_any_part(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTLOOP_CACHE", str(tmp_path))
    known = KnownModel("absent", "agentloop_no_such_pkg_part", "absent-part", 3, "0.1", "0" * 64, None, 9, "local")
    monkeypatch.setitem(gguf_assets.KNOWN_MODELS, known.id, known)
    with pytest.raises(ProviderError, match=r"none of its 3 parts are installed.*pip install 'agentloop\[local\]'"):
        ensure_model_file("absent")


def test_hash_mismatch_leaves_nothing_behind(fake_model: KnownModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gguf_assets.KNOWN_MODELS, "fake-model", _with(fake_model, sha256="f" * 64))
    with pytest.raises(ProviderError) as err:
        ensure_model_file("fake-model")
    assert err.value.kind == "bad_request"
    assert "sha256" in str(err.value) and "--force-reinstall" in str(err.value)
    cache = gguf_assets.cache_dir()
    # no temp file, no model, no marker (the empty lock file stays: removing one races with its lockers)
    assert [p.name for p in cache.iterdir()] == ["fake-model.gguf.lock"]


def test_wrong_total_size_is_refused_before_copying(fake_model: KnownModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gguf_assets.KNOWN_MODELS, "fake-model", _with(fake_model, size=len(WHOLE) + 1))
    with pytest.raises(ProviderError, match="add up to"):
        ensure_model_file("fake-model")
    assert not gguf_assets.cache_path("fake-model").exists()


def test_a_path_is_used_as_is(tmp_path: Path) -> None:
    f = tmp_path / "mine.gguf"
    f.write_bytes(b"GGUF anything")
    assert ensure_model_file(f"local:{f}") == f
    with pytest.raises(ProviderError, match="not found"):
        ensure_model_file(str(tmp_path / "missing.gguf"))


def test_unknown_id_lists_known_ones() -> None:
    with pytest.raises(ProviderError, match=r"local:qwen2\.5-coder-1\.5b"):
        ensure_model_file("no-such-model")


def test_status_rows(fake_model: KnownModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_assets, "llama_cpp_available", lambda: True)
    rows = {name: (ok, why) for name, ok, why in local_model_status()}
    ok, why = rows["local:fake-model"]
    assert ok and "assembled into" in why
    ensure_model_file("fake-model")
    ok, why = {n: (o, w) for n, o, w in local_model_status()}["local:fake-model"]
    assert ok and why.startswith("ready (cached at ")
    monkeypatch.setattr(gguf_assets, "llama_cpp_available", lambda: False)
    ok, why = {n: (o, w) for n, o, w in local_model_status()}["local:fake-model"]
    assert not ok and "llama-cpp-python missing" in why


def test_status_of_a_missing_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTLOOP_CACHE", str(tmp_path))
    monkeypatch.setattr(gguf_assets, "llama_cpp_available", lambda: True)
    known = KnownModel(
        "absent", "agentloop_no_such_pkg_part", "absent-part", 2, "0.1", "0" * 64, None, 9, "local-small"
    )
    monkeypatch.setitem(gguf_assets.KNOWN_MODELS, known.id, known)
    rows = {n: (o, w) for n, o, w in local_model_status()}
    assert rows["local:absent"] == (False, "model package not installed: pip install 'agentloop[local-small]'")


def test_status_is_reexported_by_the_adapter() -> None:
    from agentloop.models.local import local_model_status as reexported

    assert reexported is local_model_status


def _with(known: KnownModel, **changes: object) -> KnownModel:
    from dataclasses import replace

    return replace(known, **changes)  # type: ignore[arg-type]
