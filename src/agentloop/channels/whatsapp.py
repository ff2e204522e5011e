"""Talk to a durable agent from WhatsApp, over the WhatsApp Business Cloud API.

    async with Kernel.open(...) as kernel, WhatsAppBridge(kernel, **secrets, allow=["15551234567"]) as bridge:
        await bridge.serve("127.0.0.1", 8787)  # until cancelled

Meta delivers a number's messages to a webhook, so the bridge is a small web app (Starlette under
uvicorn: the ``server`` extra) at ``path``: ``GET`` answers Meta's verification handshake
(``hub.verify_token`` must be the configured verify token), ``POST`` takes the notifications,
each signed with the app secret (``X-Hub-Signature-256``; anything unsigned or badly signed is
refused before it is read). As with Telegram (``agentloop.channels.telegram``, whose process
handling this shares through ``agentloop.channels.bridge``) there is one durable process per
WhatsApp user, found again after a restart by its process kv ``whatsapp.chat`` =
``<phone number id>:<wa_id>``; a text becomes ``Process.send`` (mode ``queue``), ``/new`` resets
the conversation and ``/stop`` aborts the run. Answers go out through the Graph API
(``agentloop.channels.graph``) as plain text in parts of at most 4096 characters; an approval
request is an interactive message with Approve / Deny / Always reply buttons, whose answer comes
back as a message.

A notification is answered 200 only when each of its messages is admitted or durably kept: one
whose admission is not done within ``INTAKE_WAIT`` seconds is first written to the inbox of the
state file ``<data dir>/var/whatsapp/<phone number id>.json`` (atomically), and a retrier admits it
from there, with backoff, when that admission fails, and at the next start when the bridge stops or
crashes first. A message leaves the inbox once admitted (or answered, as a text no process can keep
is); closing the bridge leaves it there. One whose admission fails ``INBOX_ATTEMPTS`` times in a
row, over at least ``INBOX_PATIENCE`` times the longest backoff (a store outage must cost nothing),
is given up: logged as an error, dropped from the inbox, and its sender told (once) that it could
not be handled, so that a message no retry can admit does not keep the retrier (and the log) busy
for ever; a restart gives what is still kept as many tries again. A notification with a message
that failed, or that could not be kept (the file cannot be written; the inbox holds ``INBOX_MAX``
messages or ``INBOX_BYTES`` bytes already, which is logged as an error), is answered 503, so that
Meta delivers it again. A message admitted in time is not written anywhere. The run, and any
message sent back, happen after. Meta delivers a notification again until it gets its 200, and a
text is sent to its process with the run id ``whatsapp-<phone number id>-<wamid>``, which
``Process.send`` admits only once: a re-delivery, or one after a crash, never runs twice. What no
run id makes once (a command such as ``/new``, a button, a reply to a message the bridge cannot
take) is remembered by its wamid in the state file (the last ``HANDLED``), so that Meta's
re-delivery after a restart does not act again. Each process's follower resumes from the last
signal acted on (kept in the same state file): an answer is sent at least once. Graph says only
later, in a status notification, that a message it took could not be delivered (the user last
wrote more than 24 hours ago …): such a failure is logged, as a send refused at once is.

An ``image`` or a ``document`` message (a PDF, a plain text, Markdown or CSV file, an image sent
as a file) becomes the same ``Process.send`` with the file attached and its caption as the text:
``GET /<media id>`` on the Graph API names the file's address, which is downloaded with the access
token (only from Meta's hosts). An ``audio`` message (a voice message, or an audio file) is taken
only when the bridge has a ``transcriber``: it is downloaded the same way and reaches the agent as
its transcript, marked as such; a transcription that fails is told to the user. A ``video``
message (or a document of a video type) reaches the agent as a note of what was attached, after its
caption, and is not downloaded: the notification says its type, which with the caption is all the
agent can use (it does not say the size, so the note says that is unknown, rather than Graph being
asked for a file nobody reads). Without a transcriber audio, and always stickers and the like, are
refused with a short reply, and so are files past ``max_file_bytes``; a download that keeps failing
is reported to the user and nothing of that message is delivered (``agentloop.channels.media``). A
download (and a transcription) is part of taking the message: one that takes longer than
``INTAKE_WAIT`` is kept in the inbox like any slow admission.

At start the bridge asks Graph once whether it takes the access token and knows the phone number id
(``GraphApi.check``): when Graph says no, the start fails with ``CredentialsRefused`` naming which
(rather than the first answer to a user failing). When Graph cannot be asked (the network, a 5xx) or
answers something that says nothing certain, the bridge warns and starts all the same: its sends
are retried and Meta delivers again what was not taken, so a network down at boot should not keep a
service down once it is back. A signed notification that is not JSON, or nests deeper than
``MAX_DEPTH``, is refused with 400.

Only the numbers (wa_ids) on the allow-list reach a process: anyone else gets a short refusal (at
most once an hour) and their message goes nowhere. An empty allow-list refuses everyone. The
access token, app secret and verify token never appear in a log line.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from collections import OrderedDict
from collections.abc import Generator, Iterable, Mapping
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentloop.channels.bridge import CLOSE_GRACE, ChatBridge, RefusalThrottle, Undelivered
from agentloop.channels.graph import DEFAULT_API_VERSION, DEFAULT_GRAPH_URL, MEDIA_HOSTS, GraphApi, GraphError
from agentloop.channels.media import (
    MAX_FILE_BYTES,
    UNSUPPORTED,
    Attachment,
    FetchFailed,
    TooLarge,
    Transcriber,
    audio_type,
    shown_name,
    video_attachment,
)
from agentloop.channels.state import ChannelState
from agentloop.channels.telegram_text import describe_request, parse_callback, split_message
from agentloop.kernel import Kernel
from agentloop.messages import Origin, origin
from agentloop.process.archive import check_name
from agentloop.sockets import listening_socket

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

log = logging.getLogger("agentloop.channels.whatsapp")

CHAT_KEY = "whatsapp.chat"  # process kv: "<phone number id>:<wa_id>" of the user the process talks with
MAX_TEXT = 4096  # characters of one WhatsApp text message
MAX_BODY = 1024  # characters of an interactive message's body
MAX_BUTTON_ID = 256
MAX_NOTIFICATION = 1 << 20  # bytes of a webhook POST the bridge reads
INTAKE_WAIT = 5.0  # seconds a webhook POST waits for its messages' admission before keeping them
INBOX_MAX = 1000  # messages the inbox keeps (a notification that would need more is answered 503)
INBOX_BYTES = 4 << 20  # bytes (as JSON) the inbox keeps, at least a whole notification's
SEEN = 2048  # ids of messages taken, remembered so that a re-delivered notification is not handled again
HANDLED = 500  # of those, the ids kept in the state file (commands …: what no run id makes once)
INBOX_ATTEMPTS = 5  # failed admissions in a row after which a kept message is given up ...
# ... if they span at least this many of the longest backoff (5 minutes by default): an outage of the
# store (a database restarting) fails every message for a while, and must not cost them
INBOX_PATIENCE = 10
MAX_DEPTH = 64  # nesting of a notification's JSON (Meta's are about 10 deep)
_BUTTONS = (("Approve", "a"), ("Deny", "d"), ("Always", "r"))
_FILES = {"image": "the image", "document": "the document"}  # message types whose file the kernel takes
# message types the bridge cannot take (a voice message is an "audio" one), as the user is told of them
_UNSUPPORTED = {
    "audio": "the audio message",
    "sticker": "the sticker",
    "location": "the location",
    "contacts": "the contact",
    "button": "the button",
    "unsupported": "the message",
}

GIVEN_UP = "Sorry, your message could not be handled. Please send it again later."
HELP = (
    "Send me a message and your agent answers here.\n"
    "/new starts a fresh conversation.\n"
    "/stop stops the answer under way."
)
CONTEXT = (
    "The user talks with you through WhatsApp, which shows your answers as plain text: "
    "write without Markdown headings, tables or links in brackets."
)


def _field(value: object, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else None


def _wa_id(value: object) -> str | None:
    return value if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 32 else None


def _speaker(wa_id: str) -> Origin:
    """Who wrote a message: the bridge talks with each user in a chat of their own (a ``direct``
    one: the model is not told, the history keeps it)."""
    return origin("", f"whatsapp:{wa_id}", "direct")


def _message_id(message: dict[str, Any]) -> str | None:
    wamid = message.get("id")
    if not isinstance(wamid, str) or not wamid or len(wamid) > 256 or not wamid.isprintable():
        return None
    return wamid


class WhatsAppState(ChannelState):
    """``ChannelState`` plus ``handled``: the ids of the messages taken whose re-delivery would act
    again (a command …), oldest first, at most ``HANDLED``. In the file, so that Meta's re-delivery
    after a restart is known; ``ChannelState`` keeps no such list (its other channels read the
    service from an offset, or keep their own)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.handled: list[str] = []

    def add_handled(self, wamid: str) -> None:
        """Add ``wamid``, forgetting the oldest past ``HANDLED`` (written with the next ``save``)."""
        self.handled = [*self.handled, wamid][-HANDLED:]  # (replaced: the file is written from a thread)

    def _read(self, data: dict[str, Any]) -> None:
        super()._read(data)
        handled = data.get("handled")
        found = [wamid for wamid in handled if isinstance(wamid, str)] if isinstance(handled, list) else []
        self.handled = found[-HANDLED:]

    def _write(self, data: dict[str, Any]) -> None:
        super()._write({**data, "handled": self.handled} if self.handled else data)


def _parse(body: bytes) -> tuple[Any, str | None]:
    """The notification in ``body``, or why it is refused (400). Nested past Python's recursion
    limit, ``json.loads`` raises ``RecursionError`` (which would be a 500); nested less, but past
    ``MAX_DEPTH``, it would raise that later, where the inbox writes it: no notification of Meta's
    is near either."""
    from agentloop.server.strict_json import too_deep  # (the server extra: as the webhook's Starlette)

    try:
        notification = json.loads(body)
    except ValueError:
        return None, "not JSON"
    except RecursionError:
        return None, "nested too deep"
    if too_deep(notification, MAX_DEPTH):
        return None, "nested too deep"
    return notification, None


def check_signature(secret: str, body: bytes, header: str | None) -> bool:
    """Whether ``header`` is ``sha256=<hex HMAC-SHA256 of body with secret>`` (compared in
    constant time)."""
    if not header or not header.startswith("sha256="):
        return False
    expected = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected.encode(), header[len("sha256=") :].strip().lower().encode())


def sign(secret: str, body: bytes) -> str:
    """The ``X-Hub-Signature-256`` header Meta sends with ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def approval_message(wa_id: str, payload: Mapping[str, Any], request_id: str) -> dict[str, Any] | None:
    """The interactive message asking to approve ``payload``'s call; None for a request id no
    button can carry."""
    ids = [f"hil:{key}:{request_id}" for _, key in _BUTTONS]
    if any(parse_callback(i) is None or len(i) > MAX_BUTTON_ID for i in ids):
        return None
    body = describe_request(payload, max_argument=200, max_arguments=600)
    if len(body) > MAX_BODY:
        body = body[: MAX_BODY - 1] + "…"
    buttons = [
        {"type": "reply", "reply": {"id": i, "title": title}} for (title, _), i in zip(_BUTTONS, ids, strict=True)
    ]
    interactive = {"type": "button", "body": {"text": body}, "action": {"buttons": buttons}}
    return {"to": wa_id, "type": "interactive", "interactive": interactive}


class WhatsAppBridge(ChatBridge[str]):
    """Connects a WhatsApp Business number to ``kernel``: see the module doc.

    ``access_token`` sends (Graph API), ``app_secret`` checks the webhook's signatures,
    ``verify_token`` answers Meta's verification; ``phone_number_id`` is the number's id (not the
    number). ``allow`` are the wa_ids (phone numbers, digits only) that may talk to the agent;
    ``path`` is where the webhook listens; ``account`` the account every process belongs to
    (default ``whatsapp-<wa_id>``); ``state_dir`` where the state file is kept (default
    ``<data dir>/var/whatsapp``); ``backoff`` the (first, longest) wait between retries;
    ``max_file_bytes`` the largest image or document taken; ``media_hosts`` the hosts a file may
    be downloaded from with the token (``graph.MEDIA_HOSTS``); ``transcriber`` turns audio
    messages into text (without one they are refused)."""

    CHAT_KEY = CHAT_KEY
    OWNER_PREFIX = "whatsapp-"
    NAME = "whatsapp"
    APP = "WhatsApp"
    log = log

    def __init__(
        self,
        kernel: Kernel,
        *,
        access_token: str,
        app_secret: str,
        verify_token: str,
        phone_number_id: str,
        allow: Iterable[str],
        path: str = "/whatsapp",
        graph_url: str = DEFAULT_GRAPH_URL,
        api_version: str = DEFAULT_API_VERSION,
        account: str | None = None,
        context: str = CONTEXT,
        state_dir: str | Path | None = None,
        backoff: tuple[float, float] = (1.0, 30.0),
        max_file_bytes: int = MAX_FILE_BYTES,
        media_hosts: Iterable[str] = MEDIA_HOSTS,
        transcriber: Transcriber | None = None,
    ) -> None:
        allowed = [str(n).lstrip("+") for n in allow]
        if any(_wa_id(n) is None for n in allowed):
            raise ValueError("allow must be phone numbers in international form, digits only (15551234567)")
        for name, value in (("app_secret", app_secret), ("verify_token", verify_token)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must not be empty")
        if not isinstance(path, str) or not path.startswith("/") or "?" in path or "#" in path:
            raise ValueError(f"path must begin with '/', got {path!r}")
        if account is not None:
            check_name(account, "account")
        self.api = GraphApi(
            access_token,
            phone_number_id,
            graph_url=graph_url,
            api_version=api_version,
            backoff=backoff,
            secrets=(app_secret, verify_token),
            media_hosts=tuple(media_hosts),
        )
        self.state_dir = Path(state_dir) if state_dir is not None else kernel.data_dir / "var" / "whatsapp"
        state = WhatsAppState(self.state_dir / f"{self.api.phone_number_id}.json")
        super().__init__(
            kernel,
            account=account,
            context=context,
            state=state,
            backoff=self.api.backoff,
            max_file_bytes=max_file_bytes,
            transcriber=transcriber,
        )
        self._state = state  # (``self.state``, typed as the WhatsApp one)
        self.phone_number_id = self.api.phone_number_id
        self.allow = frozenset(allowed)
        self.path = path
        self._app_secret = app_secret
        self._verify_token = verify_token
        self._refused: RefusalThrottle[str] = RefusalThrottle()
        self._last_in: dict[str, str] = {}  # wa_id -> its latest text's wamid (what "typing…" is shown on)
        self._seen: OrderedDict[str, None] = OrderedDict()  # (taken: admitted, or answered)
        self._taking: dict[str, asyncio.Future[None]] = {}  # wamid -> done when its take ends
        # wamid -> (failed admissions in a row, loop time of the first) of a kept message
        self._attempts: dict[str, tuple[int, float]] = {}
        self._kept = asyncio.Event()  # set when a message is put in the inbox
        self._retrying: asyncio.Task[None] | None = None
        self._notices: set[asyncio.Task[Any]] = set()
        self._server: Any = None  # the uvicorn.Server of ``serve``
        self._serving: asyncio.Task[None] | None = None
        self.port: int | None = None
        self._started = False

    def redact(self, text: str) -> str:
        return self.api.redact(text)

    def _kv_value(self, chat: str) -> str:
        return f"{self.phone_number_id}:{chat}"

    def _chat_of(self, value: str) -> str | None:
        number, _, chat = value.partition(":")
        return _wa_id(chat) if number == self.phone_number_id else None

    # -- life ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Check the access token and the phone number id with Graph (``CredentialsRefused`` when
        it refuses them, see the module doc), find the users' processes again (by their kv) and
        follow them, and admit what the inbox kept. Webhook notifications are taken from then on,
        by ``app`` (or ``serve``)."""
        if self._started:
            return
        try:
            await self._check_credentials()
            await asyncio.to_thread(self.state.load)
            self._seen.update(dict.fromkeys(self._state.handled))
            await self._find_chats()
        except BaseException:
            await self.close()
            raise
        self._started = True
        if self.state.inbox:
            log.info("%d WhatsApp message(s) kept in the inbox are admitted now", len(self.state.inbox))
        self._retry()
        if not self.allow:
            log.warning("no WhatsApp number is allowed: every message is refused")

    async def _check_credentials(self) -> None:
        """``GraphApi.check``, whose ``CredentialsRefused`` goes to the caller. Any other failure
        says nothing certain about the token, and the bridge's sends are retried: a warning, and
        the bridge starts. An answer that is not Graph's (a proxy's page, a test's fake that does
        not serve the path) is noted only at debug level: it is not about the token either."""
        try:
            await self.api.check()
        except GraphError as exc:
            if exc.transient or exc.code is not None:
                log.warning("%s: the access token is not checked, and the bridge starts all the same", exc)
            else:
                log.debug("%s: the access token is not checked", exc)

    async def serve(self, host: str = "127.0.0.1", port: int = 8787) -> None:
        """Start (``start``) and serve the webhook on ``host``:``port`` until cancelled or closed."""
        await self.listen(host, port)
        await self.wait()

    async def listen(self, host: str = "127.0.0.1", port: int = 8787) -> int:
        """Start (``start``) and serve the webhook in the background; the port it listens on
        (``port`` 0 picks a free one). OSError when it cannot listen there, said before Graph is
        asked anything: what is wrong here is told first."""
        import uvicorn

        class _Server(uvicorn.Server):  # (the caller handles signals, not uvicorn)
            @contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                yield

        sock = listening_socket(host, port)
        try:
            await self.start()
        except BaseException:
            sock.close()
            raise
        config = uvicorn.Config(
            self.app(), log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2
        )
        self._server = server = _Server(config)
        self._serving = task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.wait({task}, timeout=0.02)
        if not server.started:
            sock.close()
            await asyncio.gather(task, return_exceptions=True)
            raise OSError(f"the webhook server on {host}:{port} did not start")
        self.port = int(sock.getsockname()[1])
        return self.port

    async def wait(self) -> None:
        """Until the webhook server ends (when cancelled, or closed)."""
        if self._serving is not None:
            await asyncio.gather(self._serving, return_exceptions=True)

    async def close(self) -> None:
        """Stop serving, then following (before the kernel closes), and close the HTTP client.
        Input or a signal being handled, and notices being sent (and those the webhook's input
        says as it ends), get ``CLOSE_GRACE`` seconds; so do the inbox's retrier and the followers,
        and the notices the retrier's input says as it ends share that grace with them."""
        if self._server is not None:
            self._server.should_exit = True
        if self._serving is not None:
            await asyncio.gather(self._serving, return_exceptions=True)
        loop = asyncio.get_running_loop()
        await self._notices_sent(loop.time() + CLOSE_GRACE)
        given_up = set(self._notices)  # (still on their way after their grace: not waited for again)
        stopping = loop.time()
        await self._stop_tasks({"intake": self._retrying})  # (the inbox stays in the file)
        await self._notices_sent(stopping + CLOSE_GRACE, given_up)
        for task in list(self._notices):
            task.cancel()
        await asyncio.gather(*self._notices, return_exceptions=True)
        self._server = self._serving = self._retrying = None
        self._started = False
        await self.api.close()

    async def _notices_sent(self, deadline: float, given_up: AbstractSet[asyncio.Task[Any]] = frozenset()) -> None:
        """Wait, until the loop time ``deadline`` at most, for the notices on their way (but those
        ``given_up``) and for those made meanwhile: input being taken says what it did (``_say``)
        as it ends, in a notice made then, which a wait for the ones already made would leave to be
        cancelled."""
        loop = asyncio.get_running_loop()
        while (waiting := self._notices - given_up) and (left := deadline - loop.time()) > 0:
            await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)

    # -- the webhook -----------------------------------------------------------------------------

    def app(self) -> Starlette:
        """The webhook as an ASGI app (``GET`` and ``POST`` at ``path``)."""
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=[Route(self.path, self._webhook, methods=["GET", "POST"])])

    async def _webhook(self, request: Request) -> Response:
        from starlette.responses import PlainTextResponse, Response

        if request.method == "GET":  # Meta's verification of the address
            params = request.query_params
            token = params.get("hub.verify_token") or ""
            good = hmac.compare_digest(token.encode(), self._verify_token.encode())
            if params.get("hub.mode") == "subscribe" and good:
                return PlainTextResponse(params.get("hub.challenge") or "")
            log.warning("refused a webhook verification: wrong mode or verify token")
            return Response("forbidden", 403, media_type="text/plain")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_NOTIFICATION):
            return Response("too large", 413, media_type="text/plain")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_NOTIFICATION:
                return Response("too large", 413, media_type="text/plain")
        signature = request.headers.get("x-hub-signature-256")
        if not signature:
            log.warning("refused a webhook notification without a signature")
            return Response("unsigned", 401, media_type="text/plain")
        if not check_signature(self._app_secret, body, signature):
            log.warning("refused a webhook notification with a wrong signature")
            return Response("bad signature", 403, media_type="text/plain")
        notification, refused = _parse(body)
        if refused is not None:
            log.warning("refused a signed webhook notification: %s", refused)
            return Response(refused, 400, media_type="text/plain")
        self._failures(notification)
        messages: dict[str, dict[str, Any]] = {}
        for message in self._messages(notification):
            wamid = _message_id(message)
            if wamid is not None:
                messages.setdefault(wamid, message)
        if messages:
            taken: set[str] = set()
            intake = asyncio.ensure_future(self._intake(messages, taken))
            self._notices.add(intake)
            intake.add_done_callback(self._notices.discard)
            await asyncio.wait({intake}, timeout=INTAKE_WAIT)  # (it goes on if it takes longer)
            if intake.done():
                if intake.cancelled() or intake.exception() is not None or not intake.result():
                    # a message was not admitted (the store was unreachable, the bridge closing …):
                    # Meta delivers it again
                    return Response("not taken", 503, media_type="text/plain")
            else:  # the 200 is given for what is admitted or kept only
                pending = {w: m for w, m in messages.items() if w not in taken and w not in self._seen}
                if pending and not await self._keep(pending):
                    return Response("not kept", 503, media_type="text/plain")
        return Response("ok", 200, media_type="text/plain")

    def _messages(self, notification: object, key: str = "messages") -> list[dict[str, Any]]:
        """The user messages of a notification sent to this number (``key`` "statuses": what
        became of the messages it sent)."""
        found: list[dict[str, Any]] = []
        entries = _field(notification, "entry")
        for entry in entries if isinstance(entries, list) else []:
            changes = _field(entry, "changes")
            for change in changes if isinstance(changes, list) else []:
                value = _field(change, "value")
                number = _field(_field(value, "metadata"), "phone_number_id")
                if number is not None and str(number) != self.phone_number_id:
                    continue  # (an app may serve several numbers)
                messages = _field(value, key)
                found += [m for m in (messages if isinstance(messages, list) else []) if isinstance(m, dict)]
        return found

    def _failures(self, notification: object) -> None:
        """Log the messages the notification says could not be delivered. Graph takes a message
        (200, with an id) before it tries to deliver it: a failure (more than 24 hours since the
        user last wrote, a number that cannot receive it …) comes later, as a status, and would
        otherwise leave no trace of the answer that was lost."""
        for status in self._messages(notification, "statuses"):
            if status.get("status") != "failed":
                continue
            errors = status.get("errors")
            error = errors[0] if isinstance(errors, list) and errors else None
            code = _field(error, "code")
            title = _field(error, "title") or _field(error, "message") or "no reason given"
            details = _field(_field(error, "error_data"), "details")
            why = f"{title}: {details}" if isinstance(details, str) and details else str(title)
            log.error(
                "WhatsApp could not deliver message %s to %s: %s%s",
                str(status.get("id"))[:300],
                str(status.get("recipient_id"))[:32],
                self.redact(why)[:500],
                f" (code {code})" if isinstance(code, int) and not isinstance(code, bool) else "",
            )

    async def _intake(self, messages: Mapping[str, dict[str, Any]], taken: set[str]) -> bool:
        """Take the messages (by wamid), adding each taken to ``taken``; False when one of them
        failed (a re-delivery, or the retrier when it was kept, takes it again)."""
        ok = True
        for wamid, message in messages.items():
            if await self._admit(wamid, message):
                taken.add(wamid)
            else:
                ok = False
        return ok

    async def _admit(self, wamid: str, message: dict[str, Any]) -> bool:
        """Take the message unless it was taken; whether it is taken now (it then leaves the
        inbox). One being taken already (a re-delivery meanwhile; the retrier and the webhook) is
        waited for, and taken again when that failed. Only a message taken is remembered as seen:
        a re-delivery of one that failed takes it again (and admits its text once, by its run id)."""
        durable = False
        while wamid not in self._seen:
            running = self._taking.get(wamid)
            if running is not None:
                await asyncio.wait({running})  # (not cancelled with this task)
                continue
            self._taking[wamid] = done = asyncio.get_running_loop().create_future()
            try:
                async with self._lock("intake"):
                    durable = await self._take(message, wamid)
            except Exception as exc:
                log.error("WhatsApp message %s was not handled: %s", wamid, self.redact(f"{type(exc).__name__}: {exc}"))
                return False
            finally:
                del self._taking[wamid]
                done.set_result(None)
            self._remember(wamid, durable)
        await self._unkeep(wamid, save=durable)
        return True

    def _remember(self, wamid: str, durable: bool) -> None:
        """Remember the message as taken (the last ``SEEN``); ``durable`` ones also in the state
        (the last ``HANDLED``, written by the caller): what a re-delivery after a restart would do
        again, as nothing else makes it once."""
        self._seen[wamid] = None
        while len(self._seen) > SEEN:
            self._seen.popitem(last=False)
        if durable:
            self._state.add_handled(wamid)

    # -- the inbox -------------------------------------------------------------------------------

    async def _keep(self, messages: Mapping[str, dict[str, Any]]) -> bool:
        """Put the messages (by wamid) in the inbox, and write it: whether they are kept. False
        (logged) when the inbox is full or cannot be written: the caller answers 503."""
        inbox = self.state.inbox
        held = {entry["id"] for entry in inbox}
        new = [message for wamid, message in messages.items() if wamid not in held]
        if new:
            size = sum(len(json.dumps(entry)) for entry in (*inbox, *new))
            if len(inbox) + len(new) > INBOX_MAX or size > INBOX_BYTES:
                log.error(
                    "the WhatsApp inbox is full (%d messages, %d bytes with these): %d message(s) whose"
                    " admission is slow are not kept, and answered 503 for Meta to deliver them again",
                    len(inbox),
                    size,
                    len(new),
                )
                return False
            inbox.extend(new)
            self._retry()
        if not await self.state.save():  # (the whole inbox: a message kept by another call too)
            log.error("the WhatsApp inbox cannot be written: answered 503, for Meta to deliver again")
            return False
        return True

    async def _unkeep(self, wamid: str, *, save: bool = False) -> None:
        """Take the message out of the inbox, and write the state when that (or ``save``) changed
        it. When the write fails, the next start admits it again (once), or acts again on a command
        whose id was not written: at least once, as with a crash."""
        inbox = self.state.inbox
        self._attempts.pop(wamid, None)
        if any(entry["id"] == wamid for entry in inbox):
            inbox[:] = [entry for entry in inbox if entry["id"] != wamid]
            save = True
        if save:
            await self.state.save()

    def _retry(self) -> None:
        """Wake the retrier (started when there is none)."""
        if self._retrying is None or self._retrying.done():
            self._retrying = asyncio.create_task(self._retrier(), name="agentloop-whatsapp-inbox")
        self._kept.set()

    async def _retrier(self) -> None:
        """Admit the inbox's messages, in order, until it is empty; after a round in which one
        failed, again after a backoff."""
        first, longest = self._backoff
        delay = first
        while True:
            if not self.state.inbox:
                self._kept.clear()
                await self._kept.wait()
                continue
            failed = 0
            for message in list(self.state.inbox):
                wamid = message["id"]
                if not any(entry["id"] == wamid for entry in self.state.inbox):
                    continue  # (admitted meanwhile, by a re-delivery)
                if _message_id(message) is None:
                    log.error("WhatsApp message %r in the inbox has no usable id: it is dropped", wamid[:300])
                    await self._unkeep(wamid)
                elif not await self._admit(wamid, message) and not await self._given_up(wamid, message):
                    failed += 1
            if failed:
                log.error("%d WhatsApp message(s) kept in the inbox: tried again in %.1f s", failed, delay)
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 0.05), longest)
            else:
                delay = first

    async def _given_up(self, wamid: str, message: dict[str, Any]) -> bool:
        """Count a kept message's failed admission; whether it is given up now, having failed
        ``INBOX_ATTEMPTS`` times in a row over at least ``INBOX_PATIENCE`` longest backoffs: logged
        (its id and sender only), its sender (when allowed) told once, and dropped from the inbox,
        so that the retrier stops trying it."""
        now = asyncio.get_running_loop().time()
        attempts, since = self._attempts.get(wamid, (0, now))
        attempts += 1
        self._attempts[wamid] = (attempts, since)
        if attempts < INBOX_ATTEMPTS or now - since < INBOX_PATIENCE * self._backoff[1]:
            return False
        wa_id = _wa_id(message.get("from"))
        log.error(
            "WhatsApp message %s from %s failed %d times: it is given up, and dropped from the inbox",
            wamid,
            wa_id or "an unknown number",
            attempts,
        )
        if wa_id is not None and wa_id in self.allow:
            await self._say(wa_id, GIVEN_UP)
        await self._unkeep(wamid)
        return True

    async def _take(self, message: dict[str, Any], wamid: str) -> bool:
        """Act on the message; whether its id must be kept in the state file, as Meta's re-delivery
        after a restart would act again (a command, a button, a reply). A text or a file reaches its
        process under a run id admitted once, and a refusal is throttled: neither is written."""
        wa_id = _wa_id(message.get("from"))
        if wa_id is None:
            return False
        if wa_id not in self.allow:
            self._refuse(wa_id)
            return False
        kind = message.get("type")
        if kind == "text":
            return await self._take_text(message, wamid, wa_id)
        if kind == "interactive":
            await self._press(message, wa_id)
            return True
        if kind in _FILES or kind == "video" or (kind == "audio" and self.transcriber is not None):
            await self._take_file(message, wamid, wa_id)
            return False
        if kind in _UNSUPPORTED:
            await self._say(wa_id, UNSUPPORTED)
            return True
        return False

    async def _take_text(self, message: dict[str, Any], wamid: str, wa_id: str) -> bool:
        """A command, or a text for the user's process; whether it was a command (see ``_take``)."""
        text = _field(message.get("text"), "body")
        if not isinstance(text, str) or not text.strip():
            return False
        command = text.strip().lower()
        if command in ("/start", "/help"):
            await self._say(wa_id, HELP)
        elif command == "/new":
            await self._reset(wa_id)
        elif command == "/stop":
            await self._stop(wa_id)
        else:  # (a re-delivered message is admitted once)
            self._last_in[wa_id] = wamid
            run_id = f"whatsapp-{self.phone_number_id}-{wamid}"
            await self._deliver(wa_id, wa_id, text, run_id, origin=_speaker(wa_id))
            return False
        return True

    async def _press(self, message: dict[str, Any], wa_id: str) -> None:
        """An approval button's answer."""
        button = parse_callback(_field(_field(message.get("interactive"), "button_reply"), "id"))
        if button is None:
            await self._say(wa_id, "Unknown button.")
            return
        key, request_id = button
        await self._say(wa_id, await self._decide(wa_id, key, request_id))

    async def _take_file(self, message: dict[str, Any], wamid: str, wa_id: str) -> None:
        """An image, a document, a video or (with a transcriber) an audio message, for the user's
        process, with its caption as the text."""
        kind = str(message.get("type"))
        part = message.get(kind)
        caption = _field(part, "caption") if kind != "audio" else None  # (an audio message has none)
        media_id = _field(part, "id")
        ref = media_id if isinstance(media_id, str) else ""
        if kind in _FILES:
            attachment = self._file(kind, part, ref)
        elif kind == "video":
            attachment = self._video(part, ref)
        else:
            attachment = self._audio(part, ref)
        self._last_in[wa_id] = wamid
        run_id = f"whatsapp-{self.phone_number_id}-{wamid}"
        caption = caption if isinstance(caption, str) else ""
        await self._deliver_files(wa_id, wa_id, caption, run_id, [attachment], origin=_speaker(wa_id))

    def _file(self, kind: str, part: object, ref: str) -> Attachment:
        """The attachment of an image or a document message (``part``: its ``image`` or
        ``document``); one the kernel cannot take has the kind None, and is refused with a reply."""
        name = shown_name(_field(part, "filename"), "")
        classified, mime = self._classify(_field(part, "mime_type"), name)
        if kind == "image" and classified != "image":  # (a HEIC photo …)
            classified = None
        shown = name or ("the audio file" if classified == "audio" else _FILES[kind])
        return Attachment(classified, mime, name, shown, None, ref)

    def _video(self, part: object, ref: str) -> Attachment:
        """The attachment of a video message: its note needs its type (MP4 when it says none) and,
        where it has one, its name; the size is not in the notification (None: said to be
        unknown), and finding it out (``GET /<media id>``) is left undone, as is the download."""
        return video_attachment(_field(part, "mime_type"), _field(part, "filename"), "the video", None, ref)

    def _audio(self, part: object, ref: str) -> Attachment:
        """The attachment of an audio message (a voice message, or an audio file)."""
        what = "the voice message" if _field(part, "voice") is True else "the audio message"
        mime = audio_type(_field(part, "mime_type")) or "audio/ogg"
        return Attachment("audio", mime, "", what, None, ref)

    async def _fetch(self, attachment: Attachment, cap: int) -> bytes:
        """``GET /<media id>`` for the file's address, then the file, with the token."""
        try:
            url, size = await self.api.media(attachment.ref)
        except GraphError as exc:
            raise FetchFailed(str(exc), transient=exc.transient) from None
        if size is not None and size > cap:
            raise TooLarge(f"{size} bytes")
        return await self.api.download(url, cap)

    def _refuse(self, wa_id: str) -> None:
        if not self._refused.due(wa_id):
            log.debug("refused another message from WhatsApp number %s", wa_id)
            return
        log.warning("refused a message from WhatsApp number %s: not on the allow-list", wa_id)
        self._later(self._send(wa_id, "Sorry, this agent is private: your number is not on its allow-list."))

    # -- to WhatsApp -----------------------------------------------------------------------------

    def _later(self, work: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    async def _say(self, chat: str, text: str) -> None:
        # (said while a notification waits for its 200: sent after it, so Meta is answered quickly)
        self._later(self._send(chat, text))

    async def _typing(self, chat: str) -> None:
        """Mark the user's latest text read and show "typing…" under it (for 25 seconds, or until
        the answer): one try, as it costs only looks. Nothing when no text of theirs was seen since
        the bridge started."""
        wamid = self._last_in.get(chat)
        if wamid is None:
            return
        indicator = {"status": "read", "message_id": wamid, "typing_indicator": {"type": "text"}}
        try:
            await self.api.send(indicator, attempts=1)
        except GraphError as exc:
            log.info("%s (typing indicator)", exc)

    async def _send(self, chat: str, text: str) -> Undelivered | None:
        """``text`` to the user, in as many messages as it takes. Transient failures are retried
        until they pass; a permanent one is logged, and the text dropped (``Undelivered``)."""
        parts = split_message(text, MAX_TEXT)
        for n, part in enumerate(parts):
            failed = await self._post({"to": chat, "type": "text", "text": {"body": part, "preview_url": False}})
            if failed is not None:
                return Undelivered(failed, n, len(parts))
        return None

    async def _send_approval(self, chat: str, payload: Mapping[str, Any], request_id: str) -> None:
        message = approval_message(chat, payload, request_id)
        if message is not None:
            await self._post(message)

    async def _post(self, message: dict[str, Any]) -> str | None:
        """Send ``message``: None once sent, else why not (logged, and the message dropped)."""
        try:
            await self.api.send(message)
            return None
        except GraphError as exc:
            log.error("%s (to %s): the message is dropped", exc, message.get("to"))
            return str(exc)
