"""An async client for the server's ``/v1`` HTTP API (docs/server-api.md).

    async with AgentloopClient("http://127.0.0.1:8765", token) as client:
        proc = await client.spawn()
        await client.send(proc["pid"], "hello")
        async for event in client.events(proc["pid"]):
            print(event.seq, event.signal, event.payload)

Every failure the server reports becomes a ``ClientError(status, code, message)``, and so does a
server nobody can reach (status 0, code ``unreachable``), so a caller handles one exception type.
The event stream reconnects by itself after a dropped connection, sending ``Last-Event-ID`` so the
server replays exactly the logged signals the client has not seen: nothing lost, nothing repeated.
The account stream (``account_events``: approvals and run ends of all the account's processes)
reconnects the same way, with ``Last-Event-ID`` set to the last account seq it saw (each event's
``id``), so nothing between is lost either.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from types import TracebackType
from typing import Any, NamedTuple, TypeVar
from urllib.parse import quote

import httpx

from agentloop.urls import check_server_address, check_token, redact_secrets, redact_url

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8765"
# The server sends a comment every 15 s of silence: three missed ones mean the connection is dead.
STREAM_READ_TIMEOUT = 45.0


class ClientError(Exception):
    """A failed call: the HTTP status (0 when the server could not be reached), the error code of
    the wire contract (``not_found``, ``unauthorized`` …), a message fit to show a person, and the
    seconds the server asked the caller to wait before trying again (``Retry-After``: a 429, a 409
    that passes), if it said so.

    Refusals a caller commonly handles apart come as subclasses (``Unauthorized``, ``Forbidden``,
    ``NotFound``, ``Conflict``, ``RateLimited``), so ``except NotFound`` reads as what it means;
    ``except ClientError`` still catches them all.

    ``details``: what else the error's JSON said, for the refusals that say more than a message
    (a send's ``run_not_current`` or ``busy`` carries ``current_run_id``: the run to decide on)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        retry_after: float | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{message} ({code})" if code else message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.details = details if details is not None else {}


class Unauthorized(ClientError):
    """401: no token, or one the server does not know (any more)."""


class Forbidden(ClientError):
    """403: a valid token, but not the account's action to take."""


class NotFound(ClientError):
    """404: no such process or request (or someone else's)."""


class Conflict(ClientError):
    """409: the state forbids it now; ``retry_after`` says when it may pass."""


class RateLimited(ClientError):
    """429: too many inputs this minute; ``retry_after`` says when to try again."""


_KINDS: dict[int, type[ClientError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    429: RateLimited,
}
# the longest Retry-After the event stream honours before reconnecting (a bad header is no reason
# to stop following for an hour)
MAX_RETRY_AFTER = 60.0


class StreamEvent(NamedTuple):
    """One signal from the event stream. ``seq`` is None for live-only progress (text deltas)."""

    seq: int | None
    signal: str
    payload: dict[str, Any]


class AccountEvent(NamedTuple):
    """One signal of the account stream: which process, what, its seq in that process's log, and
    ``id``, its account seq (what the stream resumes after). ``id`` is None for a new title (live
    only); ``pid`` is None only for ``account.log.pruned``, which says the stream resumed after
    an account seq the server no longer keeps the signals after (list the approvals again)."""

    pid: str | None
    signal: str
    payload: dict[str, Any]
    seq: int | None
    id: int | None = None


def _segment(value: str) -> str:
    """One path segment, percent-encoded whole: a pid like ``x/../<other>`` must name no other
    route or process once the server has decoded and normalised the path (nor may ``..`` itself,
    which the URL would resolve before it is sent)."""
    if value in ("", ".", ".."):
        raise ClientError(400, "invalid_request", f"{value!r} is not a valid id")
    return quote(value, safe="")


def _retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (the delay form; the date form is not used by the server)."""
    value = response.headers.get("retry-after", "").strip()
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None


def _error(response: httpx.Response, body: bytes) -> ClientError:
    """The ``ClientError`` of an answer that is not a success: a redirect (not followed: the
    address to use instead is the caller's to fix), the API's JSON error, or anything else (a
    proxy's HTML page), said by its status line rather than repeated."""
    status = response.status_code
    kind = _KINDS.get(status, ClientError)
    retry_after = _retry_after(response)
    if 300 <= status < 400:
        where = response.headers.get("location")
        try:
            to = f" to {redact_url(str(response.url.join(where)))}" if where else ""
        except (httpx.InvalidURL, ValueError):
            to = ""
        message = f"the server answered a redirect (HTTP {status}){to}: use that address"
        return ClientError(status, "bad_response", message)
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("code"), str):
        message = str(data.get("message") or data["code"])
        details = {k: v for k, v in data.items() if k not in ("code", "message")}
        return kind(status, data["code"], message, retry_after=retry_after, details=details)
    line = f"HTTP {status} {response.reason_phrase}".rstrip()
    kind_of_body = response.headers.get("content-type", "").partition(";")[0].strip().lower()
    text = body.decode("utf-8", "replace").strip()
    if kind_of_body == "text/plain" and text:  # a plain-text reason is worth showing; markup is not
        line = f"{line}: {redact_secrets(' '.join(text.split()))[:200]}"
    elif text:
        line = f"{line} ({kind_of_body or 'a body'} that is not the API's JSON; is this an agentloop server?)"
    return kind(status, "http_error", line, retry_after=retry_after)


def _transient(exc: ClientError) -> bool:
    """Worth retrying a stream: the server is unreachable, restarting or overloaded."""
    return exc.status == 0 or exc.status >= 500 or exc.status == 429


class SSEParser:
    """The ``text/event-stream`` framing: fields accumulate until a blank line dispatches them.

    Kept apart from the HTTP code so it can be fed line by line from any source."""

    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None

    def feed(self, line: str) -> tuple[str, str, str | None] | None:
        """One line (without its newline); returns ``(event, data, id)`` when a frame completes."""
        if not line:
            if not self._data:  # no event; but an id alone still moves the last event id (as a browser's)
                frame_id, self._event, self._id = self._id, "", None
                return ("", "", frame_id) if frame_id is not None else None
            frame = (self._event or "message", "\n".join(self._data), self._id)
            self._event, self._data, self._id = "", [], None
            return frame
        if line.startswith(":"):
            return None  # a comment: the server's heartbeat
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            self._id = value
        return None


class AgentloopClient:
    """The ``/v1`` API over one pooled HTTP connection set. Use it as an async context manager
    (or call ``aclose``); ``transport`` lets tests talk to an app in process."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        try:  # a typo in the address or token is the caller's to fix, not a server to retry
            check_server_address(url)
            if token:
                check_token(token)
        except ValueError as exc:
            raise ClientError(0, "invalid_argument", str(exc)) from None
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    async def __aenter__(self) -> AgentloopClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- plumbing -------------------------------------------------------------------------------

    def _unreachable(self, exc: httpx.HTTPError) -> ClientError:
        where, why = redact_url(self.url), redact_secrets(str(exc))  # a URL may carry a password
        return ClientError(0, "unreachable", f"cannot reach the server at {where}: {type(exc).__name__} {why}")

    async def _call(self, method: str, path: str, *, body: Any = None, params: dict[str, Any] | None = None) -> Any:
        """One request; its answer, a JSON object (every route answers one). Anything else, from a
        server that is not agentloop's, is a ``ClientError`` here rather than an AttributeError in
        the caller's code."""
        try:
            response = await self._http.request(method, path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        if response.status_code >= 300:
            raise _error(response, response.content)
        try:
            data = response.json()
        except ValueError:
            raise ClientError(
                response.status_code, "bad_response", "the server answered something that is not JSON"
            ) from None
        if not isinstance(data, dict):
            what = f"a JSON {type(data).__name__}, not an object"
            raise ClientError(response.status_code, "bad_response", f"the server answered {what}")
        return data

    # -- calls ------------------------------------------------------------------------------------

    async def health(self) -> bool:
        try:
            data = await self._call("GET", "/v1/health")
        except ClientError:
            return False
        return isinstance(data, dict) and data.get("ok") is True

    async def me(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/v1/me")
        return result

    async def usage(self) -> dict[str, Any]:
        """``{"account", "usage": {input, output, total_tokens, cost, runs}}``: what the account's
        processes (killed ones too) have spent over their finished runs."""
        result: dict[str, Any] = await self._call("GET", "/v1/usage")
        return result

    async def spawn(
        self,
        *,
        context: str | None = None,
        interactive: bool | None = None,
        cwd: str | None = None,
        mode: str | None = None,
        model: str | None = None,
        reasoning: str | None = None,
        tools: list[str] | None = None,
        text: str | None = None,
        media: list[dict[str, str]] | None = None,
        run_id: str | None = None,
        output_schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A new process; ``mode``: ``agent`` (the default) or ``chat`` (runs without tools);
        ``model`` (``provider:model``) and ``reasoning``: its own model choice; ``tools``: its tool
        scope (``set_tools``; None: every tool). ``text`` is a first
        message (with ``media`` as ``send`` takes them), its run starting with the process
        (``run_id`` names it; ``output_schema``, a JSON Schema, asks that run for a value, as
        ``send`` does)."""
        fields = (("context", context), ("interactive", interactive), ("cwd", cwd), ("mode", mode), ("model", model))
        first = (("text", text), ("media", media or None), ("run_id", run_id), ("output_schema", output_schema))
        body = {k: v for k, v in (*fields, ("reasoning", reasoning), ("tools", tools), *first) if v is not None}
        result: dict[str, Any] = await self._call("POST", "/v1/processes", body=body)
        return result

    async def processes(self) -> list[dict[str, Any]]:
        data = await self._call("GET", "/v1/processes")
        return list(data.get("processes", []))

    async def process(self, pid: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", f"/v1/processes/{_segment(pid)}")
        return result

    async def send(
        self,
        pid: str,
        text: str,
        *,
        mode: str = "steer",
        media: list[dict[str, str]] | None = None,
        run_id: str | None = None,
        output_schema: dict[str, Any] | None = None,
        expected_run_id: str | None = None,
    ) -> dict[str, Any]:
        """Deliver input; ``output_schema`` (a JSON Schema) asks the run answering it for a value:
        its ``proc.run.finished`` event carries it as ``output`` (such input never joins a run).
        ``expected_run_id``: only while that run is current (``Conflict`` with code
        ``run_not_current`` otherwise); ``mode="reject"``: only to an idle process (``Conflict``,
        ``busy``); either refusal delivers nothing and names the run in ``details["current_run_id"]``."""
        body: dict[str, Any] = {"text": text, "mode": mode}
        if media:
            body["media"] = media
        if run_id is not None:
            body["run_id"] = run_id
        if output_schema is not None:
            body["output_schema"] = output_schema
        if expected_run_id is not None:
            body["expected_run_id"] = expected_run_id
        result: dict[str, Any] = await self._call("POST", f"/v1/processes/{_segment(pid)}/messages", body=body)
        return result

    async def history(self, pid: str, *, limit: int = 100, before: int | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if before is not None:
            params["before"] = before
        result: dict[str, Any] = await self._call("GET", f"/v1/processes/{_segment(pid)}/messages", params=params)
        return result

    async def stop(self, pid: str, run_id: str | None = None) -> bool:
        """Ask the active run to finish gently (``POST …/stop``); False when none is active."""
        body = {"run_id": run_id} if run_id else {}
        data = await self._call("POST", f"/v1/processes/{_segment(pid)}/stop", body=body)
        return bool(data.get("stopping"))

    async def abort(self, pid: str, run_id: str | None = None) -> bool:
        body = {"run_id": run_id} if run_id else {}
        data = await self._call("POST", f"/v1/processes/{_segment(pid)}/abort", body=body)
        return bool(data.get("aborted"))

    async def retry(self, pid: str, run_id: str | None = None) -> dict[str, Any]:
        """Run the model again on the history, with no new input, where the last run ended without
        an answer (``POST …/retry``): the receipt ``{run_id, queued, position}`` of the run it
        starts. ``Conflict`` with code ``busy`` while a run is active, ``nothing_to_retry`` when the
        conversation ended with an answer; a ``run_id`` makes it idempotent (its first receipt)."""
        body = {"run_id": run_id} if run_id else {}
        result: dict[str, Any] = await self._call("POST", f"/v1/processes/{_segment(pid)}/retry", body=body)
        return result

    async def mode(self, pid: str, mode: str | None = None) -> str:
        """The process's mode (agent or chat), after setting it when ``mode`` is given."""
        if mode is None:
            data = await self._call("GET", f"/v1/processes/{_segment(pid)}/mode")
        else:
            data = await self._call("POST", f"/v1/processes/{_segment(pid)}/mode", body={"mode": mode})
        return str(data.get("mode"))

    async def tools(self, pid: str) -> dict[str, Any]:
        """The process's tool scope: ``{pid, tools, available}`` (``tools`` null: every tool;
        ``available``: the names it could be given)."""
        result: dict[str, Any] = await self._call("GET", f"/v1/processes/{_segment(pid)}/tools")
        return result

    async def set_tools(self, pid: str, tools: list[str] | None) -> dict[str, Any]:
        """Offer the process's runs only ``tools`` from its next run on (tool names,
        ``mcp:<server>``, globs; None: every tool). A name it has no tool of is a ``ClientError``
        400 listing the available ones, and nothing changes."""
        body = {"tools": tools}
        result: dict[str, Any] = await self._call("POST", f"/v1/processes/{_segment(pid)}/tools", body=body)
        return result

    async def compaction(self, pid: str) -> dict[str, Any]:
        """The process's compaction policy: ``{pid, threshold, overflow, keep_recent_tokens,
        default_threshold}`` (``GET …/compaction``)."""
        result: dict[str, Any] = await self._call("GET", f"/v1/processes/{_segment(pid)}/compaction")
        return result

    async def set_compaction(
        self,
        pid: str,
        *,
        threshold: float | None = None,
        overflow: str = "compact",
        keep_recent_tokens: int | None = None,
    ) -> dict[str, Any]:
        """Replace the process's compaction policy, from its next run on (``POST …/compaction``):
        compact at ``threshold`` (None: the server's), ``overflow`` ``compact`` or ``fail``, keep
        ``keep_recent_tokens`` out of a summary (None: the default). All defaults: the server's."""
        body = {"threshold": threshold, "overflow": overflow, "keep_recent_tokens": keep_recent_tokens}
        result: dict[str, Any] = await self._call("POST", f"/v1/processes/{_segment(pid)}/compaction", body=body)
        return result

    async def models(self) -> dict[str, Any]:
        """The models a picker may offer: ``{models: [{model, context_window, max_output,
        input_cost, output_cost, vision, reasoning, usable, why}], default}`` (``usable``: this
        server can call it; ``why``: or what it needs). Any other ``provider:model`` may be named."""
        result: dict[str, Any] = await self._call("GET", "/v1/models")
        return result

    async def model(self, pid: str) -> dict[str, Any]:
        """The process's model: ``{pid, model, reasoning, effective, source}`` (``model`` and
        ``reasoning`` its own choice, ``effective`` what its next run uses, ``source`` where that
        comes from: ``process``, ``account`` or ``default``)."""
        result: dict[str, Any] = await self._call("GET", f"/v1/processes/{_segment(pid)}/model")
        return result

    async def set_model(self, pid: str, model: str | None, *, reasoning: str | None = None) -> dict[str, Any]:
        """Give the process its own model (``provider:model``) and reasoning level from its next
        run on; None (and no level) returns it to the account's or the server's. One the server
        cannot use is a ``ClientError`` 400, and nothing changes."""
        body = {"model": model, "reasoning": reasoning}
        result: dict[str, Any] = await self._call("POST", f"/v1/processes/{_segment(pid)}/model", body=body)
        return result

    async def title(self, pid: str) -> str | None:
        """The process's title: a person's, or the one made after its first run; None before."""
        data = await self._call("GET", f"/v1/processes/{_segment(pid)}/title")
        title = data.get("title")
        return title if isinstance(title, str) else None

    async def set_title(self, pid: str, title: str | None) -> str | None:
        """Name the process (trimmed; one line of plain text, at most 120 characters, else
        ``ClientError`` 400); None clears the name, handing it back to the automatic title."""
        data = await self._call("POST", f"/v1/processes/{_segment(pid)}/title", body={"title": title})
        named = data.get("title")
        return named if isinstance(named, str) else None

    async def approvals(self, pid: str | None = None, *, account: str | None = None) -> list[dict[str, Any]]:
        """The pending approval requests of the process ``pid``; without one, of all the account's
        processes, each with its ``pid`` (``account``: another account's, for an admin)."""
        if pid is None:
            data = await self._call("GET", "/v1/approvals", params={"account": account} if account else None)
        else:
            data = await self._call("GET", f"/v1/processes/{_segment(pid)}/hil")
        return list(data.get("requests", []))

    async def approval_audit(
        self,
        *,
        account: str | None = None,
        pid: str | None = None,
        since: float | None = None,
        decision: str | None = None,
        by: str | None = None,
        before: str | None = None,
        limit: int | None = None,
    ) -> dict[str, Any]:
        """A page of the account's approvals audit, newest first: ``{"entries": [...],
        "next_before": id or None}``; pass ``next_before`` as ``before`` for the older page. The
        filters (``pid``, ``since`` in epoch seconds, ``decision``, the answering account ``by``)
        go as given; ``account``: another account's, for an admin."""
        given = {"account": account, "pid": pid, "since": since, "decision": decision, "by": by, "before": before}
        params = {k: str(v) for k, v in given.items() if v is not None}
        if limit is not None:
            params["limit"] = str(limit)
        data = await self._call("GET", "/v1/approvals/audit", params=params)
        return {"entries": list(data.get("entries", [])), "next_before": data.get("next_before")}

    async def hil(
        self,
        pid: str,
        request_id: str,
        decision: str,
        *,
        remember: bool | str = False,
        message: str | None = None,
        arguments: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Approve or deny a pending call; ``message`` (deny only) tells the model why; ``arguments``
        (approve only) run in place of the model's; ``remember`` (approve only) is ``True``/``"process"``,
        ``"run"`` or ``"account"`` (see ``Process.hil``)."""
        body: dict[str, Any] = {"decision": decision, "remember": remember}
        if message is not None:  # left out otherwise: a server without the field would refuse it
            body["message"] = message
        if arguments is not None:  # (likewise)
            body["arguments"] = arguments
        result: dict[str, Any] = await self._call(
            "POST", f"/v1/processes/{_segment(pid)}/hil/{_segment(request_id)}", body=body
        )
        return result

    async def reset(self, pid: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("POST", f"/v1/processes/{_segment(pid)}/reset", body={})
        return result

    async def compact(
        self,
        pid: str,
        instructions: str | None = None,
        *,
        keep_last: int | None = None,
        through: int | None = None,
        summary: str | None = None,
    ) -> dict[str, Any]:
        """Summarise the history now (``POST …/compact``): ``{compacted, note, removed, tokens_before,
        tokens_after, archive, segment_id}``. ``keep_last`` (keep the newest N messages) or
        ``through`` (a message id: summarise up to and including it) choose the cut; ``summary``
        is your own text, installed with no model call. ``Conflict`` while a run is active."""
        options = {"instructions": instructions or None, "keep_last": keep_last, "through": through, "summary": summary}
        body = {name: value for name, value in options.items() if value is not None}
        result: dict[str, Any] = await self._call("POST", f"/v1/processes/{_segment(pid)}/compact", body=body)
        return result

    async def rewind(self, pid: str, at: int) -> dict[str, Any]:
        """Cut the process's history back to message id ``at`` (``POST …/rewind``; 0: the start):
        what follows it is archived as a segment, then removed. ``{kept, removed, segment}``;
        ``Conflict`` while a run is active, ``ClientError`` 400 for a point that is not a message
        of the history or ends inside a tool call batch (the message names valid ones)."""
        result: dict[str, Any] = await self._call("POST", f"/v1/processes/{_segment(pid)}/rewind", body={"at": at})
        return result

    async def segments(self, pid: str) -> list[dict[str, Any]]:
        """What compactions, clearings and resets put away (``GET …/segments``), oldest first."""
        data = await self._call("GET", f"/v1/processes/{_segment(pid)}/segments")
        return list(data.get("segments", []))

    async def segment(
        self, pid: str, segment_id: str, *, limit: int = 100, before: int | None = None
    ) -> dict[str, Any]:
        """A page of one segment's archived messages: ``{segment, messages: [{index, message}],
        next_before}`` (the newest page by default; ``NotFound`` for an unknown segment)."""
        params: dict[str, Any] = {"limit": limit}
        if before is not None:
            params["before"] = before
        path = f"/v1/processes/{_segment(pid)}/segments/{_segment(segment_id)}"
        result: dict[str, Any] = await self._call("GET", path, params=params)
        return result

    async def fork(
        self,
        pid: str,
        *,
        at: int | None = None,
        segment: str | None = None,
        context: str | None = None,
        fork_id: str | None = None,
    ) -> dict[str, Any]:
        """A new process from this one's conversation (``POST …/fork``): its history up to and
        including message id ``at`` (None: all of it), or the archived ``segment``; ``context``:
        the fork's own process context (None: the source's). The new process, with
        ``forked_from``; ``Conflict`` past the account's process quota. Asked again with the same
        ``fork_id``, the server answers with the fork it made the first time."""
        chosen = (("at", at), ("segment", segment), ("context", context), ("fork_id", fork_id))
        body: dict[str, Any] = {k: v for k, v in chosen if v is not None}
        result: dict[str, Any] = await self._call("POST", f"/v1/processes/{_segment(pid)}/fork", body=body)
        return result

    async def kill(self, pid: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("DELETE", f"/v1/processes/{_segment(pid)}")
        return result

    async def queue(self, pid: str) -> list[dict[str, Any]]:
        """The input waiting for the process (``GET …/queue``), in the order it will be taken."""
        data = await self._call("GET", f"/v1/processes/{_segment(pid)}/queue")
        return list(data.get("items", []))

    async def withdraw(self, pid: str, item_id: int | None = None, *, kind: str | None = None) -> list[dict[str, Any]]:
        """Withdraw waiting input before it runs; returns what was withdrawn. ``item_id``: that item
        (``NotFound`` once a run has taken it); else the items of ``kind``, by default all the
        user's input (system events only when asked for by kind)."""
        path = f"/v1/processes/{_segment(pid)}/queue"
        if item_id is not None:
            path += f"/{int(item_id)}"
        data = await self._call("DELETE", path, params={"kind": kind} if kind is not None else None)
        return list(data.get("withdrawn", []))

    async def devices(self) -> list[dict[str, Any]]:
        """The caller's devices, online and offline (every account's for an admin)."""
        data = await self._call("GET", "/v1/devices")
        return list(data.get("devices", []))

    async def device_token(self, name: str) -> dict[str, Any]:
        """Issue the token device ``name`` connects with (``{device, token, token_id}``; the token
        is shown only this once), registering the device if new; one issued before stops working."""
        result: dict[str, Any] = await self._call("POST", f"/v1/devices/{_segment(name)}/token")
        return result

    async def revoke_device_token(self, name: str) -> bool:
        """Revoke device ``name``'s token (its connection closes); ``NotFound`` if it has none."""
        result = await self._call("DELETE", f"/v1/devices/{_segment(name)}/token")
        return bool(result.get("revoked"))

    async def forget_device(self, name: str) -> bool:
        """Forget device ``name``: its registry entry and token go, freeing its place among the
        account's devices, and its connection closes; ``NotFound`` if it is not registered."""
        result = await self._call("DELETE", f"/v1/devices/{_segment(name)}")
        return bool(result.get("forgotten"))

    # -- the event stream -------------------------------------------------------------------------

    async def events(
        self,
        pid: str,
        *,
        after_seq: int = 0,
        follow: bool = True,
        reconnect: bool = True,
        max_retries: int | None = None,
        connected: asyncio.Event | None = None,
        on_retry: Callable[[ClientError, int], None] | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """The process's signals after ``after_seq``, then (with ``follow``) live ones.

        A dropped connection, or a stream the server ended because it was shutting down, is
        reopened with ``Last-Event-ID`` after a growing, jittered pause (reset by every event that
        arrives), at most ``max_retries`` times in a row (None: until the server answers an error
        that retrying cannot fix, such as 404 for a killed process, or a page that is not an event
        stream); a ``Retry-After`` sent with a 429 or 503 is waited out. ``connected`` is set each
        time the server has accepted the stream, so a caller can start a run only once it is
        watching (text deltas are live-only: sent before that, they are missed). ``on_retry(problem,
        attempt)`` is told before each reconnection, so a person watching knows why it paused."""
        last = after_seq
        stream = self._reopening(
            lambda: self._stream(pid, last, follow, connected),
            follow=follow,
            reconnect=reconnect,
            max_retries=max_retries,
            connected=connected,
            on_retry=on_retry,
        )
        async with aclosing(stream):  # (closed here, not by the loop's finalizer in another task)
            async for event in stream:
                if event.seq is not None:
                    last = event.seq  # (where a reopened stream goes on from)
                yield event

    async def _reopening(
        self,
        opened: Callable[[], AsyncGenerator[T, None]],
        *,
        follow: bool,
        reconnect: bool,
        max_retries: int | None,
        connected: asyncio.Event | None,
        on_retry: Callable[[ClientError, int], None] | None,
    ) -> AsyncGenerator[T, None]:
        """The items of the connections ``opened`` makes: one after another, as ``events`` says."""
        failures = 0
        while True:
            ended_cleanly = False
            try:
                async with aclosing(opened()) as items:
                    async for item in items:
                        failures = 0
                        yield item
                ended_cleanly = True
            except ClientError as exc:
                if not (reconnect and _transient(exc)):
                    raise
                problem: ClientError = exc
            if ended_cleanly:
                if not follow or not reconnect:
                    return
                problem = ClientError(0, "stream_ended", "the server ended the event stream")
            if connected is not None:
                connected.clear()
            failures += 1
            if max_retries is not None and failures > max_retries:
                raise problem
            if on_retry is not None:
                on_retry(problem, failures)
            delay = min(5.0, 0.2 * 2 ** (failures - 1)) * (0.5 + random.random() / 2)
            if problem.retry_after is not None:  # the server said how long it needs: not sooner
                delay = max(delay, min(problem.retry_after, MAX_RETRY_AFTER))
            await asyncio.sleep(delay)

    async def _stream(
        self, pid: str, after_seq: int, follow: bool, connected: asyncio.Event | None
    ) -> AsyncGenerator[StreamEvent, None]:
        """One connection of the event stream; errors (HTTP or network) become ``ClientError``."""
        headers = {"Accept": "text/event-stream"}
        if after_seq:
            headers["Last-Event-ID"] = str(after_seq)
        params = {"after_seq": after_seq, "follow": "true" if follow else "false"}
        path = f"/v1/processes/{_segment(pid)}/events"
        async with aclosing(self._frames(path, params, headers, connected)) as frames:
            async for frame in frames:
                event = _event(*frame)
                if event is not None:
                    yield event

    async def account_events(
        self,
        *,
        after_seq: int | None = None,
        connected: asyncio.Event | None = None,
        reconnect: bool = True,
        max_retries: int | None = None,
        on_retry: Callable[[ClientError, int], None] | None = None,
    ) -> AsyncGenerator[AccountEvent, None]:
        """The approvals asked and answered (``proc.changed`` naming "hil") and the runs finished
        of all the account's processes, runs nobody follows included: those after account seq
        ``after_seq`` (an earlier event's ``id``) first, if given, then as they happen. A dropped
        connection, or a stream the server ended as it shut down, is reopened as ``events``
        reopens its stream (without ``reconnect``: a ``ClientError``, or the end), with
        ``Last-Event-ID`` set to the last account seq seen (the server's opening id, before any
        event), so nothing in between is lost or repeated. Still, list ``approvals()`` when
        ``connected`` is first set: the stream tells of changes, the list of what is pending."""
        headers = {"Accept": "text/event-stream"}
        last = after_seq

        async def opened() -> AsyncGenerator[AccountEvent, None]:
            nonlocal last
            sent = dict(headers)
            if last is not None:
                sent["Last-Event-ID"] = str(last)
            async with aclosing(self._frames("/v1/events", {}, sent, connected)) as frames:
                async for name, data, event_id in frames:
                    number = int(event_id) if event_id is not None and event_id.isdigit() else None
                    if number is not None:
                        last = number  # (an id-only frame too: where a stream opened from now on starts)
                    event = _account_event(name, data, number)
                    if event is not None:
                        yield event

        stream = self._reopening(
            opened, follow=True, reconnect=reconnect, max_retries=max_retries, connected=connected, on_retry=on_retry
        )
        async with aclosing(stream):
            async for event in stream:
                yield event

    async def _frames(
        self, path: str, params: dict[str, Any], headers: dict[str, str], connected: asyncio.Event | None
    ) -> AsyncGenerator[tuple[str, str, str | None], None]:
        """The SSE frames of one connection to ``path``; errors (HTTP or network) become ``ClientError``."""
        timeout = httpx.Timeout(10.0, read=STREAM_READ_TIMEOUT)
        parser = SSEParser()
        try:
            async with self._http.stream("GET", path, params=params, headers=headers, timeout=timeout) as response:
                if response.status_code >= 300:
                    raise _error(response, await response.aread())
                media_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
                if media_type != "text/event-stream":
                    # some other web server (an index page for every path): read as a stream that
                    # ended, it would be reopened for ever with nothing to show for it
                    shown = media_type or "no content type"
                    raise ClientError(
                        response.status_code,
                        "bad_response",
                        f"the server answered {shown}, not an event stream; is this an agentloop server?",
                    )
                if connected is not None:
                    connected.set()
                async for line in response.aiter_lines():
                    frame = parser.feed(line.rstrip("\r"))
                    if frame is not None:
                        yield frame
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None


def _body(data: str) -> dict[str, Any] | None:
    """An event's data, if it is the JSON object every event of the API carries."""
    try:
        body = json.loads(data)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _event(name: str, data: str, event_id: str | None) -> StreamEvent | None:
    body = _body(data)
    if body is None:
        return None
    seq = body.get("seq")
    if not isinstance(seq, int) and event_id is not None and event_id.isdigit():
        seq = int(event_id)
    payload = body.get("payload")
    return StreamEvent(
        seq if isinstance(seq, int) else None,
        str(body.get("signal") or name),
        payload if isinstance(payload, dict) else {},
    )


def _account_event(name: str, data: str, event_id: int | None) -> AccountEvent | None:
    """An account stream event (``event_id``: its account seq; the seq in its data is its
    process's), or None for a frame without an event's data (the opening id-only frame)."""
    body = _body(data)
    if body is None:
        return None
    pid, seq, payload = body.get("pid"), body.get("seq"), body.get("payload")
    return AccountEvent(
        pid if isinstance(pid, str) else None,
        str(body.get("signal") or name),
        payload if isinstance(payload, dict) else {},
        seq if isinstance(seq, int) else None,
        event_id,
    )
