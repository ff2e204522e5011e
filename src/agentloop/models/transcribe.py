"""Speech to text: a voice message (or an audio file) as the words said in it.

The chat bridges (``agentloop.channels``) take voice messages when the operator names a
transcription model: ``openai:<model>`` (``openai:whisper-1``, ``openai:gpt-4o-transcribe``, or the
model id of any server that speaks OpenAI's ``POST /v1/audio/transcriptions``: a local
whisper.cpp or faster-whisper server, Groq …). The bridges know only ``channels.media.Transcriber``
(``transcribe(audio, filename, mime) -> str``); this module is the client behind it.

The key and the address follow the OpenAI provider (``models.openai_chat``): the key from
``OPENAI_API_KEY`` (or the variable ``key_env`` names), the base URL from the argument or
``OPENAI_BASE_URL``; a server at a base URL of its own needs no key (it is given a placeholder).
The key never appears in an error or a log line. The official SDK is imported only when a
transcriber is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from agentloop.models.base import endpoint
from agentloop.urls import redact_secrets, redact_url

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = [
    "DEFAULT_KEY_ENV",
    "MAX_TRANSCRIPT",
    "PROVIDERS",
    "OpenAITranscriber",
    "TranscriptionError",
    "open_transcriber",
    "parse_transcribe_model",
]

PROVIDERS = ("openai",)  # what ``<provider>:<model>`` may name (any OpenAI-compatible server)
DEFAULT_KEY_ENV = "OPENAI_API_KEY"
URL_ENV = "OPENAI_BASE_URL"
PLACEHOLDER_KEY = "sk-local-no-key"  # (as the chat provider: a local server never checks it)
DEFAULT_TIMEOUT = 120.0  # seconds one transcription may take
DEFAULT_RETRIES = 2  # the SDK's own retries of a connection error, a 408/429/5xx
MAX_TRANSCRIPT = 100_000  # characters of a transcript kept (a longer one is cut)


class TranscriptionError(Exception):
    """A transcription that failed: its message says why, briefly, and never holds the key."""


def parse_transcribe_model(spec: object) -> tuple[str, str]:
    """(provider, model id) of ``spec`` (``openai:whisper-1``), or ValueError saying what it must be."""
    if not isinstance(spec, str):
        raise ValueError(f"the transcription model must be 'provider:model', got {spec!r}")
    provider, sep, model_id = spec.strip().partition(":")
    if not sep or not provider or not model_id.strip():
        raise ValueError(f"the transcription model must look like 'openai:whisper-1', got {spec!r}")
    if provider not in PROVIDERS:
        known = ", ".join(PROVIDERS)
        raise ValueError(
            f"unknown transcription provider {provider!r} (known: {known}; 'openai' takes any server "
            "that speaks OpenAI's /v1/audio/transcriptions, with a base URL)"
        )
    return provider, model_id.strip()


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"the transcription base URL must be an http(s) address, got {redact_url(url)!r}")
    return url.rstrip("/")


class OpenAITranscriber:
    """Transcribes with ``model_id`` over OpenAI's ``POST /v1/audio/transcriptions`` (multipart:
    the audio as ``file``, the model, ``response_format=json``; the answer ``{"text": ...}``).

    ``api_key`` (default: ``$<key_env>``) and ``base_url`` (default: ``$OPENAI_BASE_URL``, else
    OpenAI) as the chat provider takes them; ``language`` (ISO-639-1) and ``prompt`` are passed on
    when given; ``timeout`` the seconds one call may take, ``max_retries`` the SDK's retries;
    ``client`` replaces the SDK client (tests). Close it with ``close``."""

    def __init__(
        self,
        model_id: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        key_env: str = DEFAULT_KEY_ENV,
        language: str | None = None,
        prompt: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_RETRIES,
        client: AsyncOpenAI | None = None,
    ) -> None:
        if not isinstance(model_id, str) or not model_id.strip():
            raise ValueError("the transcription model id must not be empty")
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be a whole number from 0, got {max_retries!r}")
        self.model_id = model_id.strip()
        self._api_key, url = endpoint(api_key, base_url, key_env=key_env, url_env=URL_ENV, placeholder=PLACEHOLDER_KEY)
        self.base_url = _check_url(url) if url is not None else None
        self.key_env = key_env
        self.language = language
        self.prompt = prompt
        self.timeout = float(timeout)
        self.max_retries = max_retries
        self._client = client

    def __repr__(self) -> str:  # (never the key)
        where = redact_url(self.base_url) if self.base_url else "OpenAI"
        return f"OpenAITranscriber({self.model_id!r} at {where})"

    def check(self) -> None:
        """ValueError when no call could be made: no key and no base URL (said before any voice
        message comes), or no SDK."""
        if self._client is None and self._api_key is None:
            raise ValueError(
                f"the transcription model needs an API key: set {self.key_env} (or give a base URL of a "
                "server that needs none)"
            )
        if self._client is None:
            _sdk()

    @property
    def client(self) -> AsyncOpenAI:
        """Built on first use (within the loop that uses it)."""
        if self._client is None:
            if self._api_key is None:
                raise TranscriptionError(f"no API key for the transcription model: set {self.key_env}")
            sdk = _sdk()
            self._client = sdk.AsyncOpenAI(
                api_key=self._api_key, base_url=self.base_url, timeout=self.timeout, max_retries=self.max_retries
            )
        return self._client

    async def transcribe(self, audio: bytes, filename: str, mime: str) -> str:
        """The words said in ``audio`` (a file named ``filename`` of type ``mime``: the server
        tells the format by the name's suffix), or ``TranscriptionError``."""
        sdk = _sdk()
        options: dict[str, Any] = {}
        if self.language:
            options["language"] = self.language
        if self.prompt:
            options["prompt"] = self.prompt
        try:
            result = await self.client.audio.transcriptions.create(
                model=self.model_id, file=(filename, audio, mime), response_format="json", **options
            )
        except sdk.APIStatusError as exc:
            raise TranscriptionError(f"the transcription server answered HTTP {exc.status_code}{_said(exc)}") from None
        except sdk.APITimeoutError:
            raise TranscriptionError(f"the transcription took longer than {self.timeout:g} s") from None
        except sdk.APIConnectionError as exc:
            cause = exc.__cause__ or exc
            reason = redact_secrets(f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__)
            raise TranscriptionError(f"the transcription server could not be reached ({reason[:300]})") from None
        except sdk.OpenAIError as exc:  # (an answer the SDK could not read …)
            raise TranscriptionError(f"the transcription failed: {redact_secrets(str(exc))[:300]}") from None
        except ValueError as exc:  # a JSON answer that is not JSON (empty, cut off): the SDK lets it out as is
            reason = redact_secrets(f"{type(exc).__name__}: {exc}")[:300]
            raise TranscriptionError(f"the transcription server's answer is not JSON ({reason})") from None
        text = getattr(result, "text", None)
        if not isinstance(text, str):  # (a body that is not the JSON asked for: the SDK hands it over as is)
            raise TranscriptionError("the transcription server's answer holds no text")
        return text[:MAX_TRANSCRIPT]

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


def _said(exc: Any) -> str:
    """What an error answer says (its ``error.message``), briefly and with no credential."""
    body = getattr(exc, "body", None)
    message = body.get("message") if isinstance(body, dict) else None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
    if not isinstance(message, str) or not message.strip():
        return ""
    return f": {redact_secrets(' '.join(message.split()))[:200]}"


def _sdk() -> Any:
    try:
        import openai
    except ImportError as exc:  # pragma: no cover (a core dependency today)
        raise ValueError(f"transcription needs the openai package: pip install openai ({exc})") from None
    return openai


def open_transcriber(
    spec: str, *, base_url: str | None = None, key_env: str | None = None, **options: Any
) -> OpenAITranscriber:
    """The transcriber ``spec`` names (``openai:whisper-1``), checked: ValueError saying what is
    wrong (the spec, the base URL, no key)."""
    _, model_id = parse_transcribe_model(spec)
    if key_env is not None and not (key_env.strip() and key_env.isidentifier()):
        raise ValueError(f"the transcription key variable must be an environment variable's name, got {key_env!r}")
    env = key_env.strip() if key_env else DEFAULT_KEY_ENV
    transcriber = OpenAITranscriber(model_id, base_url=(base_url or "").strip() or None, key_env=env, **options)
    transcriber.check()
    return transcriber
