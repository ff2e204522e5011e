"""Talk to a durable agent from Discord.

    async with Kernel.open(...) as kernel, DiscordBridge(kernel, token, allow=[80351110224678912]) as bridge:
        await bridge.wait()  # until cancelled, or a failure no retry can mend (DiscordError)

``DiscordBridge`` holds a connection to Discord's gateway (a WebSocket, API v10, JSON) and keeps
one durable process per Discord channel: a direct message channel, or a server (guild) channel
where the bot is mentioned. In a DM every message is for the bot; in a server channel only those
that mention it (``@bot what is …``; the mention is taken out of the text), so the bot can sit in a
busy channel without answering everything. A mention of the bot's own role (the one Discord manages
for the bot in each server, which the mention autocomplete offers beside the bot: its
``tags.bot_id`` names the bot) counts as a mention of the bot, and is taken out as well. The
server's roles are read (``GET /guilds/<id>/roles``) when a message mentions one the bridge does
not know (at most every ``ROLES_REFRESH`` seconds); ``GUILD_CREATE`` would carry them, but only to
a session with the Guilds intent, which the bridge does not ask for (it would bring every server's
channels and members at each connect).

A message becomes ``Process.send`` (mode ``queue``: while the agent is still answering, it waits
for its own run); ``!new`` resets the conversation, ``!stop`` aborts the run and ``!help`` says so.
The same three are slash commands, ``/new``, ``/stop`` and ``/help``: global application commands
of the bot's application (its id from READY's ``application``, else the bot's own), registered
after the first READY with one bulk overwrite (``PUT /applications/<id>/commands``), and only when
what is registered (``GET`` the same address) differs from them, so a restart rewrites nothing. A
failure to register (no access, no network) is logged and the ``!`` commands work all the same. A
slash command comes as an ``INTERACTION_CREATE`` (type 2) from a DM or a server channel (no mention
needed) and does what its ``!`` twin does to that channel's process, checked against the same
allow-list. Discord drops an interaction not answered within 3 seconds, while a command waits its
turn behind the messages before it (an attachment being downloaded …), so each is answered as it
arrives, outside that queue: ``/help``, a refusal and an unknown command at once with their text
(seen only by the user), ``/new`` and ``/stop`` with a deferred response (type 5: the user sees
"thinking…"; ``/stop``'s only for the user, as all it says is a note to them: its run's end says
"Stopped." in the channel). Once the command is handled, in order, its answer replaces the deferred
response (``PATCH /webhooks/<application>/<token>/messages/@original``); should the deferral or
that edit fail, what "new" or "stop" said is told in the channel instead.

A follower per process reads its signals (``agentloop.channels.bridge``): ``proc.run.started``
shows "typing…", ``proc.run.hil.requested`` sends the call to approve with
Approve / Deny / Always buttons (whose presses come back as ``INTERACTION_CREATE``, type 3; like a
slash command, each is acknowledged as it arrives, outside the intake queue: a stranger's press or
an unknown button is refused at once with a note only the presser sees, an approval answer gets a
deferred update (type 6) at once and is decided in its turn, in order; then the pressed message is
edited (``PATCH …/messages/@original``): its buttons go, the outcome is added. A press on a
request no longer pending when it arrives is told so at once, in a note only the presser sees; one
answered while the press waited its turn, in a followup note only they see (``POST
/webhooks/<application>/<token>``, the token kept out of every log line). Should the deferral fail,
the press is answered as before, by updating the message in the response (type 7); should the edit
(or that update) fail, the outcome is told in the channel. A command or a press whose handling is
given up after ``TRIES`` is told so, instead of "thinking…" for 15 minutes), and ``proc.run.finished`` sends the
answer, in parts of at most 2000 characters, with ``allowed_mentions`` empty so that nothing the
model writes pings anyone (``@everyone``).

A message's attachments (up to ``media.MAX_FILES``: images, and PDF, plain text, Markdown or CSV
documents) are downloaded from Discord's CDN, without the bot token and only from the CDN's own
addresses (``attachment_urls``: an address anywhere else is never fetched), and go with the text
(or a short default) as one ``Process.send``. A forwarded message (whose text and files Discord
sends in ``message_snapshots``) is taken as the user's own. A voice message or an audio attachment is taken only
when the bridge has a ``transcriber``: it reaches the agent as its transcript, marked as such, after
the text. A video attachment (a ``video/*`` content type) reaches the agent as a note of what was
attached (its file name, type and size, as the message says them), after the text, and is not
downloaded from the CDN: no model could use its bytes. Without a transcriber voice messages and
audio, and always stickers and other files, are refused with a short reply, and so are files past
``max_file_bytes``; a download that keeps failing is reported to the user and nothing of that
message is delivered (``agentloop.channels.media``).

Only the Discord users on the allow-list (user ids) reach a process or answer an approval: anyone
else gets a short refusal (with their user id, so the bot's owner can add them; at most once an
hour per channel) and their message goes nowhere. An empty allow-list refuses everyone.

The gateway: ``GET /gateway/bot`` names its address; on Hello the bridge beats every
``heartbeat_interval`` (the first beat after a random part of it, as Discord asks) and identifies
(intents: server and direct messages, and their content). A beat not acknowledged by the next one
means the connection is dead though open (a "zombie"): it is closed and resumed. A drop, an op 7
Reconnect or an op 9 Invalid Session that may be resumed reconnects to the session's
``resume_gateway_url`` and resumes (op 6), so that Discord replays what was dispatched meanwhile
(after ``RESUME_TRIES`` failures in a row to get there, through the gateway's main address instead);
an op 9 that may not be resumed identifies anew after 1–5 seconds. A close that no retry can mend
(4004: the token was refused, 4010–4014: a bad shard, API version or intents, or the Message
Content intent not enabled for the bot) ends the bridge with a ``DiscordError``; anything else is
retried with the bridge's backoff.

What survives a restart:

- the channel's process: it is spawned with the process kv ``discord.chat`` = ``<bot id>:<channel
  id>`` (in the same transaction), and found again by that key;
- per channel, the id of the newest message up to which every one was dealt with, and per process
  the last signal acted on: a small JSON file, ``<data dir>/var/discord/<bot id>.json``. The gateway
  does not replay what was said while the bridge was away (a new session begins where it connects),
  so on start, and after each new session, the bridge reads each known channel's messages after
  that id (``GET /channels/<id>/messages?after=…``) and handles them, oldest first. A message's id is
  stored only after it was handled, so a crash in between handles it again, once: its input is sent
  with the run id ``discord-<bot>-<channel>-<message id>``, which ``Process.send`` admits only once
  (and a message both caught up and dispatched is taken once, by its id). A message that needs
  nothing (one in a server channel that does not mention the bot, the bot's own, a stranger's once
  refused) moves the mark too, or each catch-up would page through a busy channel's talk again; its
  id is not written on its own, but with the next write: at the end of each catch-up page, every
  ``PAGE`` such messages, at close, or with a handled message's. A catch-up that keeps failing
  (``TRIES`` times: Discord's API or the store down) is given up, and queued again after a wait
  (the bridge's longest backoff, doubled at each give-up, up to ``RETRY_MOST``); a new session, or
  a start, catches up as well. Until a catch-up of a channel is done its mark stays where the last
  one stopped, so no live message moves it over what was not read yet; a message handled live
  there meanwhile is answered, and its id kept in the file (``taken``), so that the catch-up,
  which reads it again, does not handle it twice. A follower resumes from its last
  signal, so an answer that finished while the bridge was down is still sent. Channels the bridge
  never heard from cannot be caught up: their first message must arrive while it runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import secrets
import sys
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import httpx

from agentloop.channels.bridge import CLOSE_GRACE, NOT_PENDING, OUTCOMES, ChatBridge, RefusalThrottle, Undelivered
from agentloop.channels.discord_api import DEFAULT_API_URL, USER_AGENT, DiscordApi, DiscordError
from agentloop.channels.media import (
    MAX_FILE_BYTES,
    Attachment,
    FetchFailed,
    Transcriber,
    fetch,
    shown_name,
)
from agentloop.channels.state import ChannelState
from agentloop.channels.telegram_text import describe_request, parse_callback, split_message
from agentloop.kernel import Kernel
from agentloop.messages import ChatKind, Origin, origin
from agentloop.process.archive import check_name
from agentloop.proxies import env_proxy
from agentloop.urls import MASK, redact_url

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

log = logging.getLogger("agentloop.channels.discord")

CHAT_KEY = "discord.chat"  # process kv: "<bot id>:<channel id>" of the channel the process talks in
TRIES = 5  # times a dispatch whose handling fails is taken before it is skipped
MAX_MESSAGE = 2000  # characters of one Discord message
MAX_CUSTOM_ID = 100  # characters of a button's custom_id
PAGE = 100  # messages one catch-up request reads (Discord's most)
RETRY_MOST = 600.0  # seconds: the longest wait before a catch-up given up is tried again
HELLO_WAIT = 20.0  # seconds a new connection waits for the gateway's Hello
OPEN_WAIT = 20.0  # seconds the WebSocket handshake may take
MAX_EVENT = 8 << 20  # bytes of one gateway event
GATEWAY_VERSION = 10
# GUILD_MESSAGES | DIRECT_MESSAGES | MESSAGE_CONTENT (the last is privileged: enabled per bot in
# the Developer Portal, else the gateway closes with 4014)
INTENTS = (1 << 9) | (1 << 12) | (1 << 15)
PERMANENT_CLOSES = {
    4004: "authentication failed: the bot token was refused",
    4010: "invalid shard",
    4011: "sharding required: the bot is in too many servers for one connection",
    4012: "invalid API version",
    4013: "invalid intents",
    4014: "disallowed intents: enable the Message Content intent for the bot in the Developer Portal (Bot page)",
}
NEW_SESSION_CLOSES = frozenset({4007, 4009})  # an invalid seq, a session timed out: resuming cannot work
RESUME_TRIES = 3  # resumes in a row that fail at the session's resume address before the main one is used
ROLES_REFRESH = 60.0  # seconds: a server's roles are read again at most this often
NO_MENTIONS: dict[str, Any] = {"parse": []}
EPHEMERAL = 64  # message flag: only the presser sees the answer
CATCH_UP = "CATCH_UP"  # the intake's item that reads what was said while no session was up
COMMAND = "COMMAND"  # the intake's item for /new or /stop, acknowledged on arrival: {"interaction", "ack"}
DEFERRED = 5  # DEFERRED_CHANNEL_MESSAGE_WITH_SOURCE: an interaction's answer to come (by an edit)
PRESS = "PRESS"  # the intake's item for an approval button press, acknowledged on arrival: {"interaction", "ack"}
DEFERRED_UPDATE = 6  # DEFERRED_UPDATE_MESSAGE: a press taken, its message to be edited once decided
T = TypeVar("T")
_BUTTONS = (("Approve", "a", 3), ("Deny", "d", 4), ("Always", "r", 2))  # label, key, style (green, red, grey)
_VOICE_MESSAGE = 1 << 13  # message flag: a voice message (its one attachment is the recording)
_TEXT_TYPES = frozenset({0, 19})  # a message, a reply: the rest (joins, pins, calls …) say nothing to the bot
_SENSITIVE_FRAME = re.compile(r'"op":\s*[26][,}]')  # Identify and Resume carry the token
# an interaction's token in a dispatch (INTERACTION_CREATE): its value, up to its closing quote (or
# past the "..." where websockets elides a long frame's middle, to the next quote)
_TOKEN_VALUE = re.compile(r'("token"\s*:\s*")[^"]*')
# what follows the "..." of an elided frame up to a quote: it may be the end of a token whose key was elided
_ELIDED_TAIL = re.compile(r'(?<=\.\.\.)[^"\s]+(?=")')
_RUN = re.compile(r"[A-Za-z0-9_-]{6,}")
# where attachments are (the CDN, and its media proxy): nothing is fetched from anywhere else
ATTACHMENT_URLS = ("https://cdn.discordapp.com/", "https://media.discordapp.net/")

HELP = (
    "Send me a message and your agent answers here (in a server channel, mention me).\n"
    "/new (or !new) starts a fresh conversation.\n"
    "/stop (or !stop) stops the answer under way."
)
# the slash commands the bridge registers (global, chat input: type 1), in servers and the bot's DMs
# (contexts 0, 1) of a server-installed app (integration type 0); nothing else is registered
COMMANDS: tuple[dict[str, Any], ...] = tuple(
    {"name": name, "type": 1, "description": description, "contexts": [0, 1], "integration_types": [0]}
    for name, description in (
        ("new", "Start a fresh conversation"),
        ("stop", "Stop the answer under way"),
        ("help", "What this bot does, and its commands"),
    )
)
REFUSAL = "Sorry, this bot is private. (Your Discord user id is {}.)"
GIVEN_UP = "Sorry, that could not be done just now; please try again."
CONTEXT = (
    "The user talks with you through Discord, which shows your answers with its Markdown "
    "(bold, italics, lists, code blocks; no tables or headings deeper than ###)."
)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _snowflake(value: object) -> int | None:
    """A Discord id (sent as a string of digits) as an int; None for anything else."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        value = int(value)
    number = _int(value)
    return number if number is not None and 0 <= number < 1 << 64 else None


def _field(value: object, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else None


def speaker(message: object, user_id: int) -> Origin:
    """Who wrote ``message`` (the user ``user_id``), by the name Discord shows (their nickname in
    the server, else their display name, else their username), and whether in a server's channel
    or a direct message: in a server the model is told who speaks (``messages.Origin``)."""
    author = _field(message, "author")
    names = (_field(_field(message, "member"), "nick"), _field(author, "global_name"), _field(author, "username"))
    name = next((n for n in names if isinstance(n, str) and n.strip()), "")
    kind: ChatKind = "direct" if _field(message, "guild_id") is None else "group"
    return origin(name, f"discord:{user_id}", kind)


def _gateway_address(url: str) -> str:
    """``url`` (a gateway's ws(s) address) with the version and encoding the bridge speaks."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        shown = redact_url(url)
        raise DiscordError("gateway", f"the gateway address is not a ws(s) URL: {shown!r}", transient=True)
    query = f"v={GATEWAY_VERSION}&encoding=json"
    return urlunsplit((parts.scheme, parts.netloc, parts.path or "/", query, ""))


def _attachment_base(url: str) -> tuple[str, str, int | None, str]:
    """(scheme, host, port, path prefix) of an address attachments may be fetched from."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        raise ValueError(f"attachment_urls must be http(s) addresses, got {url!r}")
    path = parts.path if parts.path.endswith("/") else f"{parts.path}/"
    return parts.scheme, parts.hostname.lower(), parts.port, path


def _allowed(url: str, bases: Iterable[tuple[str, str, int | None, str]]) -> bool:
    """Whether ``url`` is under one of ``bases`` (scheme, host, port and path prefix all alike)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    if parts.username is not None or parts.password is not None or ".." in parts.path.split("/"):
        return False
    host = (parts.hostname or "").lower()
    return any(
        (parts.scheme, host, port) == (scheme, h, p) and parts.path.startswith(prefix) for scheme, h, p, prefix in bases
    )


@dataclass(frozen=True)
class GuildRoles:
    """A server's roles as the bridge last read them (``at``, loop seconds): every role id
    (``known``: a mention of another is news, the roles are read again) and the bot's own."""

    known: frozenset[int]
    mine: frozenset[int]
    at: float


def bot_roles(roles: object, bot_id: int) -> tuple[frozenset[int], frozenset[int]]:
    """(every role id, the ids of the bot's managed roles) of a server's ``roles``: a managed role
    is the one Discord made for a bot when it joined, and its ``tags.bot_id`` names that bot. (Any
    other role the bot has is shared with people: a mention of it is not meant for the bot.)"""
    known: set[int] = set()
    mine: set[int] = set()
    for role in roles if isinstance(roles, list) else []:
        role_id = _snowflake(_field(role, "id"))
        if role_id is None:
            continue
        known.add(role_id)
        if _snowflake(_field(_field(role, "tags"), "bot_id")) == bot_id:
            mine.add(role_id)
    return frozenset(known), frozenset(mine)


def approval_components(request_id: str) -> list[dict[str, Any]] | None:
    """An action row of Approve / Deny / Always buttons (custom_id ``hil:<key>:<request id>``, as
    the other channels' buttons); None for a request id no button can carry."""
    ids = [f"hil:{key}:{request_id}" for _, key, _ in _BUTTONS]
    if any(parse_callback(i) is None or len(i) > MAX_CUSTOM_ID for i in ids):
        return None
    buttons = [
        {"type": 2, "style": style, "label": label, "custom_id": i}
        for (label, _, style), i in zip(_BUTTONS, ids, strict=True)
    ]
    return [{"type": 1, "components": buttons}]


def commands_differ(registered: object, wanted: Iterable[Mapping[str, Any]] = COMMANDS) -> bool:
    """Whether the application's ``registered`` commands (``GET /applications/<id>/commands``) are
    other than ``wanted``: another set of names, or a command whose fields the bridge sets (lists
    in any order) are not the same, or that has options. (What the bridge does not set, Discord's
    ids, versions …, is not compared.)"""
    wanted = list(wanted)
    if not isinstance(registered, list) or len(registered) != len(wanted):
        return True
    have = {_field(command, "name"): command for command in registered}
    for want in wanted:
        command = have.get(want["name"])
        if not isinstance(command, dict) or command.get("options"):
            return True
        for key, value in want.items():
            got = command.get(key)
            if isinstance(value, list):
                if not isinstance(got, list) or sorted(got, key=repr) != sorted(value, key=repr):
                    return True
            elif got != value:
                return True
    return False


def _interaction_parts(interaction: dict[str, Any]) -> tuple[int, str, int | None] | None:
    """(id, token, user id) of an interaction (a button press, a slash command), the user being
    the member's in a server and the user's in a DM; None for one that cannot be answered."""
    interaction_id = _snowflake(interaction.get("id"))
    token = interaction.get("token")
    if interaction_id is None or not isinstance(token, str):
        return None
    user = _field(interaction.get("member"), "user") or interaction.get("user")
    return interaction_id, token, _snowflake(_field(user, "id"))


def _command_channel(interaction: dict[str, Any]) -> int | None:
    """The channel a slash command was used in."""
    return _snowflake(interaction.get("channel_id")) or _snowflake(_field(interaction.get("channel"), "id"))


def _forwarded(message: dict[str, Any]) -> dict[str, Any] | None:
    """The message a forward carries: Discord sends a forward with no content of its own, the
    forwarded message's text and files in ``message_snapshots``. None for any other message."""
    snapshots = message.get("message_snapshots")
    inner = _field(snapshots[0], "message") if isinstance(snapshots, list) and snapshots else None
    return inner if isinstance(inner, dict) else None


def _mask_token(text: str, token: str) -> str:
    """``text`` with the token and every run of six or more of its characters that is a piece of
    it masked: websockets logs a frame cut short in the middle, which a whole-token match misses."""
    text = text.replace(token, MASK)
    return _RUN.sub(lambda m: MASK if m.group(0) in token else m.group(0), text)


class _GatewayLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """The logger websockets is given: its lines (the frames, at DEBUG) with the token masked, and
    the Identify and Resume frames, which carry it, not shown at all. An interaction's token (in an
    ``INTERACTION_CREATE``: whoever holds it may answer, edit and post as the bot in that channel
    for 15 minutes) is masked too: a frame's middle is elided only up to ``WEBSOCKETS_MAX_LOG_SIZE``
    characters, which an operator raises to see whole frames."""

    def __init__(self, logger: logging.Logger, token: str) -> None:
        super().__init__(logger, {})
        self._token = token

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        try:
            text = str(msg) % args if args else str(msg)
        except (TypeError, ValueError):  # (a line whose arguments do not fit its format)
            text = f"{msg} {args}"
        if _SENSITIVE_FRAME.search(text):
            text = f"{text[:2]}(an Identify or Resume payload, not shown)"
        text = _TOKEN_VALUE.sub(lambda m: m.group(1) + MASK, text)
        if "..." in text:
            text = _ELIDED_TAIL.sub(MASK, text)
        self.logger.log(level, "%s", _mask_token(text, self._token), **kwargs)


class _Reconnect(Exception):
    """The connection is to be made again (``why``): the session is kept when it may be resumed."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class DiscordState(ChannelState):
    """``ChannelState`` plus ``last``: per channel, the id of the newest message up to which every
    one was handled or passed over (where catching up begins), and ``taken``: per channel, the
    messages past that mark handled as they came while the channel's catch-up was not done (given
    up), which the catch-up reads again and must not handle twice. ``offset`` is unused: the
    gateway has none. Both are replaced, never changed in place (``handled``, ``passed``, ``took``,
    ``settle``, ``forget``), as the file is written from another thread. ``unsaved`` counts the
    messages passed over since the last write: they are written in batches, not one write each."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.last: Mapping[int, int] = {}
        self.taken: Mapping[int, frozenset[int]] = {}
        self.unsaved = 0

    def handled(self, channel: int, message_id: int) -> None:
        self.last = {**self.last, channel: max(message_id, self.last.get(channel, 0))}

    def passed(self, channel: int, message_id: int) -> bool:
        """Move a known channel's mark over ``message_id``, which needed nothing (not written
        here): whether it moved. A channel the bridge never handled a message in stays unknown, or
        every server channel it can read would be caught up at each new session."""
        if channel not in self.last or message_id <= self.last[channel]:
            return False
        self.last = {**self.last, channel: message_id}
        self.unsaved += 1
        return True

    def took(self, channel: int, message_id: int) -> None:
        """``message_id`` was handled past the channel's mark, which stays where its catch-up stopped."""
        self.taken = {**self.taken, channel: self.taken.get(channel, frozenset()) | {message_id}}

    def settle(self, channel: int, *, done: bool = False) -> int:
        """Drop the channel's taken messages its mark has reached (every one once its catch-up is
        ``done``: one it did not read was deleted): the newest dropped, 0 for none."""
        taken = self.taken.get(channel, frozenset())
        mark = self.last.get(channel, 0)
        dropped = taken if done else frozenset(m for m in taken if m <= mark)
        if not dropped:
            return 0
        kept = taken - dropped
        self.taken = {**{c: t for c, t in self.taken.items() if c != channel}, **({channel: kept} if kept else {})}
        return max(dropped)

    def forget(self, channel: int) -> None:
        self.last = {c: m for c, m in self.last.items() if c != channel}
        self.taken = {c: t for c, t in self.taken.items() if c != channel}

    async def save(self) -> bool:
        self.unsaved = 0  # (before the data is taken: a message passed over meanwhile counts for the next write)
        saved = await super().save()
        if not saved:
            self.unsaved = max(self.unsaved, 1)  # (written again at the next batch's end)
        return saved

    def _read(self, data: dict[str, Any]) -> None:
        super()._read(data)
        last = data.get("last")
        found: dict[int, int] = {}
        for channel, message in last.items() if isinstance(last, dict) else ():
            channel_id, message_id = _snowflake(channel), _snowflake(message)
            if channel_id is not None and message_id is not None:
                found[channel_id] = message_id
        self.last = found
        self.taken = _taken(data.get("taken"), found)

    def _write(self, data: dict[str, Any]) -> None:
        # (ids as strings, as Discord writes them: a JSON reader with doubles would round them)
        data = {**data, "last": {str(c): str(m) for c, m in self.last.items()}}
        if self.taken:  # (none but after a catch-up given up: a file without them keeps its form)
            data["taken"] = {str(c): sorted(str(m) for m in t) for c, t in self.taken.items()}
        super()._write(data)


def _taken(value: object, last: Mapping[int, int]) -> dict[int, frozenset[int]]:
    """The state file's ``taken`` (channel -> message ids): those past their channel's mark."""
    found: dict[int, frozenset[int]] = {}
    for channel, messages in value.items() if isinstance(value, dict) else ():
        channel_id = _snowflake(channel)
        if channel_id is None or channel_id not in last or not isinstance(messages, list):
            continue
        ids = frozenset(m for m in map(_snowflake, messages) if m is not None and m > last[channel_id])
        if ids:
            found[channel_id] = ids
    return found


class DiscordBridge(ChatBridge[int]):
    """Connects a Discord bot to ``kernel``: see the module doc.

    ``allow`` are the Discord user ids that may talk to the agent (and answer its approvals);
    ``api_url`` Discord's HTTP API; ``account`` the account every channel's process belongs to
    (default: ``discord-<user id>`` of the person who wrote first in the channel); ``context`` is
    given to each process at spawn; ``state_dir`` where the state file is kept (default
    ``<data dir>/var/discord``); ``backoff`` the (first, longest) wait between retries;
    ``ready_timeout`` the seconds ``start`` waits for the gateway's READY; ``invalid_session_wait``
    the (least, most) seconds before identifying again after an op 9; ``max_file_bytes`` the
    largest attachment taken; ``attachment_urls`` the addresses (scheme, host and path prefix)
    attachments are downloaded from (Discord's CDN; a test's fake); ``transcriber`` turns voice
    messages and audio attachments into text (without one they are refused); ``transport``
    replaces the HTTP network (tests)."""

    CHAT_KEY = CHAT_KEY
    OWNER_PREFIX = "discord-"
    NAME = "discord"
    APP = "Discord"
    COMMAND_PREFIX = "!"
    log = log

    def __init__(
        self,
        kernel: Kernel,
        token: str,
        *,
        allow: Iterable[int],
        api_url: str = DEFAULT_API_URL,
        account: str | None = None,
        context: str = CONTEXT,
        state_dir: str | Path | None = None,
        backoff: tuple[float, float] = (1.0, 30.0),
        ready_timeout: float = 30.0,
        invalid_session_wait: tuple[float, float] = (1.0, 5.0),
        max_file_bytes: int = MAX_FILE_BYTES,
        attachment_urls: Iterable[str] = ATTACHMENT_URLS,
        transcriber: Transcriber | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        allowed = list(allow)
        if any(_snowflake(uid) is None or not isinstance(uid, int) for uid in allowed):
            raise TypeError("allow must be Discord user ids (integers)")
        if account is not None:
            check_name(account, "account")
        low, high = invalid_session_wait
        if not 0 <= low <= high:
            raise ValueError(f"invalid_session_wait must be (least, most) seconds, got {invalid_session_wait!r}")
        self.api = DiscordApi(token, api_url, backoff=backoff, timeout=30.0, transport=transport)
        self.state_dir = Path(state_dir) if state_dir is not None else kernel.data_dir / "var" / "discord"
        self.state: DiscordState = DiscordState(self.state_dir / "unknown.json")
        super().__init__(
            kernel,
            account=account,
            context=context,
            state=self.state,
            backoff=self.api.backoff,
            max_file_bytes=max_file_bytes,
            transcriber=transcriber,
        )
        self.attachment_urls = tuple(_attachment_base(url) for url in attachment_urls)
        # attachments are fetched without the bot token (a client of their own), redirects not followed
        self._files = httpx.AsyncClient(
            headers={"User-Agent": USER_AGENT},
            transport=transport or httpx.AsyncHTTPTransport(proxy=env_proxy(ATTACHMENT_URLS[0])),
            timeout=30.0,
            trust_env=False,
            follow_redirects=False,
        )
        self.allow = frozenset(allowed)
        self.bot_id = 0
        self.application_id = 0  # (READY names it: the slash commands are registered for it)
        self.username = ""
        self.ready_timeout = ready_timeout
        self.invalid_session_wait = (float(low), float(high))
        self._wslog = _GatewayLog(logging.getLogger("agentloop.channels.discord.gateway"), token)
        self._mention = re.compile(r"$^")  # (the bot's mention, once its id is known)
        self._roles: dict[int, GuildRoles] = {}  # server -> its roles, as last read
        self._refused: RefusalThrottle[tuple[int, int]] = RefusalThrottle()
        # per channel, the newest message this bridge handled (from the state's mark at start): a
        # dispatch at or below it is one caught up already. Not the state's mark itself, which a
        # message passed over moves too: a mention Discord delivers just after a newer message
        # that needed nothing must still be handled
        self._handled: dict[int, int] = {}
        # the channels whose catch-up has not ended this session, or was given up and not yet done
        # since: a dispatch there moves no mark over the messages still to be caught up (the
        # catch-up moves it, page by page); one handled is kept in the state's ``taken``
        self._behind: set[int] = set()
        self._retry: asyncio.Task[None] | None = None  # the wait before a given-up catch-up is queued again
        self._retry_wait = 0.0  # that wait, doubled at each give-up; 0 while none is given up
        self._queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self._gateway: asyncio.Task[None] | None = None
        self._registration: asyncio.Task[None] | None = None  # (the slash commands', once a run)
        self._answering: set[asyncio.Task[Any]] = set()  # slash commands and presses answered on arrival
        # while a slash command is handled: (its task, its channel, what ``_say`` said meanwhile)
        self._saying: tuple[asyncio.Task[Any] | None, int, list[str]] | None = None
        self._ready = asyncio.Event()
        # the gateway session: what a resume takes
        self._session_id: str | None = None
        self._resume_url: str | None = None
        self._seq: int | None = None
        self._acked = True  # the last heartbeat was acknowledged
        self._live = False  # this connection got its READY or RESUMED (the backoff starts over)
        self._dropped: str | None = None  # why the bridge closed the connection itself

    # -- life ------------------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        """Ask Discord who the bot is (``GET /users/@me``: a refused token raises ``DiscordError``,
        an unreachable server too after a few tries), find the channels' processes again, follow
        them, connect to the gateway and wait (``ready_timeout`` seconds at most) for its READY.
        A close the gateway means for good (4004 …) raises ``DiscordError``. Returns the bot user
        (``id``, ``username`` …)."""
        try:
            me = await self.api.request("GET", "/users/@me", attempts=4)
            bot_id = _snowflake(_field(me, "id"))
            if bot_id is None:
                raise DiscordError("GET /users/@me", "the answer names no bot")
            self.bot_id = bot_id
            self.username = str(_field(me, "username") or "")
            self._mention = re.compile(rf"\s*<@!?{bot_id}>\s*")
            self.state = DiscordState(self.state_dir / f"{bot_id}.json")
            await asyncio.to_thread(self.state.load)
            self._handled = dict(self.state.last)
            self._behind = set(self.state.last)
            await self._find_chats()
            if not self.allow:
                log.warning("no Discord user is allowed: every message is refused")
            self._worker = asyncio.create_task(self._intake(), name="agentloop-discord-intake")
            self._gateway = gateway = asyncio.create_task(self._run_gateway(), name="agentloop-discord-gateway")
            ready = asyncio.ensure_future(self._ready.wait())
            try:
                await asyncio.wait({ready, gateway}, timeout=self.ready_timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                ready.cancel()
            if gateway.done():
                gateway.result()  # (it ends only on a permanent failure: raised here)
                raise DiscordError("gateway", "the connection ended before it was ready")
            if not self._ready.is_set():
                log.warning("the Discord gateway is not ready after %.0f s: still trying", self.ready_timeout)
        except BaseException:
            await self.close()
            raise
        return cast("dict[str, Any]", me)

    async def wait(self) -> None:
        """Until the gateway connection ends: when cancelled, or closed, or on a failure no retry
        can mend (a revoked token …), which is raised (``DiscordError``)."""
        gateway = self._gateway
        if gateway is None:
            return
        await asyncio.wait({gateway})
        if not gateway.cancelled() and gateway.exception() is not None:
            raise cast("BaseException", gateway.exception())

    async def close(self) -> None:
        """Leave the gateway and stop following (before the kernel closes), and close the HTTP
        client. A message or a signal being handled is given ``bridge.CLOSE_GRACE`` seconds to
        finish first."""
        if self._retry is not None:  # (a wait, holding nothing: the next start catches up anyway)
            self._retry.cancel()
            await asyncio.gather(self._retry, return_exceptions=True)
            self._retry = None
        tasks = {"intake": self._worker, "gateway": self._gateway, "commands": self._registration}
        await self._stop_tasks(tasks)
        self._worker = self._gateway = self._registration = None
        if self.state.unsaved:  # (the messages passed over since the last write: not caught up again)
            await self.state.save()
        if self._answering:  # (answers on their way to Discord: short, given the same grace)
            await asyncio.wait(set(self._answering), timeout=CLOSE_GRACE)
            for task in self._answering:
                task.cancel()
            await asyncio.gather(*self._answering, return_exceptions=True)
            self._answering.clear()
        await self.api.close()
        await self._files.aclose()

    def _kv_value(self, chat: int) -> str:
        return f"{self.bot_id}:{chat}"

    def _chat_of(self, value: str) -> int | None:
        bot, _, chat = value.partition(":")
        return _snowflake(chat) if bot == str(self.bot_id) else None

    def redact(self, text: str) -> str:
        return self.api.redact(text)

    # -- the gateway -----------------------------------------------------------------------------

    async def _run_gateway(self) -> None:
        """Connect, and connect again (resuming the session where it can) for as long as the
        bridge runs; a close no retry can mend raises ``DiscordError``."""
        from websockets.exceptions import ConnectionClosed, WebSocketException

        first, longest = self.api.backoff
        delay = first
        stuck = 0  # resumes in a row that failed at the resume address
        while True:
            self._live = False
            self._dropped = None
            resume_at = self._resume_url if self._session_id is not None else None
            try:
                await self._connection()
                why = "the gateway ended the connection"
            except _Reconnect as again:
                why = again.why
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else None
                if code in PERMANENT_CLOSES:
                    log.error(
                        "the Discord gateway closed the connection: %s (close code %d)", PERMANENT_CLOSES[code], code
                    )
                    raise DiscordError("gateway", f"{PERMANENT_CLOSES[code]} (close code {code})", code=code) from None
                if code in NEW_SESSION_CLOSES:
                    self._forget_session()
                why = self._dropped or (f"closed with code {code}" if code is not None else "the connection dropped")
            except DiscordError as exc:
                if not exc.transient:
                    raise
                why = str(exc)
            except (OSError, TimeoutError, WebSocketException, ValueError) as exc:
                why = self.redact(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            except Exception as exc:  # (a bug: the bridge goes on all the same)
                why = self.redact(f"unexpected {type(exc).__name__}: {exc}")  # (no traceback: it may quote frames)
            if self._live:
                delay, stuck = first, 0
            elif resume_at is not None and resume_at == self._resume_url:
                stuck += 1
                if stuck >= RESUME_TRIES:  # (its host is down, or it is no gateway: the session is kept)
                    log.warning(
                        "the Discord session could not be resumed at its resume address %d times in a row:"
                        " resuming through the gateway's main address",
                        stuck,
                    )
                    self._resume_url, stuck = None, 0
            how = "resuming" if self._session_id is not None else "connecting anew"
            log.warning("the Discord gateway connection ended (%s); %s in %.1f s", why, how, delay)
            await asyncio.sleep(delay)
            delay = min(max(delay * 2, 0.05), longest)

    def _forget_session(self) -> None:
        self._session_id = self._resume_url = None
        self._seq = None

    async def _gateway_url(self) -> str:
        """Where a new session connects (``GET /gateway/bot``), once Discord allows a new one."""
        answer = await self.api.request("GET", "/gateway/bot", attempts=3)
        url = _field(answer, "url")
        if not isinstance(url, str):
            raise DiscordError("GET /gateway/bot", "the answer names no gateway address", transient=True)
        limit = _field(answer, "session_start_limit")
        reset_after = _int(_field(limit, "reset_after"))
        if _field(limit, "remaining") == 0 and reset_after is not None:
            wait = min(max(reset_after / 1000, 0.0), 86400.0)
            log.warning("Discord allows the bot no new session for now: waiting %.0f s", wait)
            await asyncio.sleep(wait)
        return url

    async def _connection(self) -> None:
        """One connection: Hello, then Resume (when a session is kept) or Identify, then its
        events until it ends (an exception says how)."""
        from websockets.asyncio.client import connect

        resuming = self._session_id is not None
        url = self._resume_url if resuming and self._resume_url else await self._gateway_url()
        async with connect(
            _gateway_address(url),
            open_timeout=OPEN_WAIT,
            close_timeout=2.0,
            ping_interval=None,  # (the gateway's heartbeat is the keepalive)
            max_size=MAX_EVENT,
            compression=None,
            user_agent_header=USER_AGENT,
            logger=self._wslog,
        ) as ws:
            hello = await asyncio.wait_for(self._receive(ws), HELLO_WAIT)
            interval = _field(hello.get("d"), "heartbeat_interval")
            if hello.get("op") != 10 or not isinstance(interval, int | float) or isinstance(interval, bool):
                raise _Reconnect("the gateway did not begin with Hello")
            beat = asyncio.create_task(
                self._heartbeat(ws, max(float(interval), 1.0) / 1000), name="agentloop-discord-beat"
            )
            try:
                if resuming:
                    resume = {"token": self.api.token, "session_id": self._session_id, "seq": self._seq}
                    await self._send_json(ws, {"op": 6, "d": resume})
                else:
                    await self._send_json(ws, {"op": 2, "d": self._identify()})
                while True:
                    await self._on_payload(ws, await self._receive(ws))
            finally:
                beat.cancel()
                await asyncio.gather(beat, return_exceptions=True)

    def _identify(self) -> dict[str, Any]:
        properties = {"os": sys.platform, "browser": "agentloop", "device": "agentloop"}
        return {"token": self.api.token, "intents": INTENTS, "properties": properties}

    async def _receive(self, ws: ClientConnection) -> dict[str, Any]:
        """The next payload (what is not a JSON object is skipped)."""
        while True:
            raw = await ws.recv()
            try:
                payload = json.loads(raw)
            except ValueError:
                log.warning("the Discord gateway sent something that is not JSON")
                continue
            if isinstance(payload, dict):
                return payload

    async def _send_json(self, ws: ClientConnection, payload: dict[str, Any]) -> None:
        await ws.send(json.dumps(payload, separators=(",", ":")))

    async def _heartbeat(self, ws: ClientConnection, interval: float) -> None:
        """Beat every ``interval`` seconds (the first after a random part of it); a beat whose
        ACK did not come by the next one closes the connection, to be resumed."""
        self._acked = True
        await asyncio.sleep(interval * random.random())
        while True:
            if not self._acked:
                self._dropped = "no heartbeat ACK: a zombie connection"
                await ws.close(4000, "zombie")  # (not 1000, which would end the session)
                return
            self._acked = False
            await self._send_json(ws, {"op": 1, "d": self._seq})
            await asyncio.sleep(interval)

    async def _on_payload(self, ws: ClientConnection, payload: dict[str, Any]) -> None:
        op = payload.get("op")
        seq = _int(payload.get("s"))
        if seq is not None:
            self._seq = seq
        if op == 0:
            self._dispatch(payload.get("t"), payload.get("d"))
        elif op == 1:  # the gateway asks for a beat now
            await self._send_json(ws, {"op": 1, "d": self._seq})
        elif op == 11:
            self._acked = True
        elif op == 7:
            await ws.close(4000, "reconnect")  # (not 1000, which would end the session)
            raise _Reconnect("Discord asked for a reconnect (op 7)")
        elif op == 9:
            if payload.get("d") is True:
                await ws.close(4000, "resume")
                raise _Reconnect("the session was invalidated, to be resumed (op 9)")
            self._forget_session()
            await asyncio.sleep(random.uniform(*self.invalid_session_wait))
            raise _Reconnect("the session was invalidated (op 9)")

    def _dispatch(self, event: object, data: object) -> None:
        if not isinstance(data, dict):
            return
        if event == "READY":
            session_id, resume_url = data.get("session_id"), data.get("resume_gateway_url")
            self._session_id = session_id if isinstance(session_id, str) and session_id else None
            self._resume_url = resume_url if isinstance(resume_url, str) and resume_url else None
            user = data.get("user")
            self.username = self.username or str(_field(user, "username") or "")
            application = _snowflake(_field(data.get("application"), "id"))
            self.application_id = application or self.application_id or self.bot_id
            if self._registration is None:  # (once a run: a new session does not register again)
                self._registration = asyncio.create_task(self._register_commands(), name="agentloop-discord-commands")
            self._live = True
            self._ready.set()
            log.info("connected to the Discord gateway as %s (%d)", self.username or "the bot", self.bot_id)
            self._queue.put_nowait((CATCH_UP, {}))  # (a new session: what was said meanwhile is not replayed)
        elif event == "RESUMED":
            self._live = True
            log.info("resumed the Discord gateway session")
        elif event == "INTERACTION_CREATE" and data.get("type") == 2:  # APPLICATION_COMMAND
            self._command_arrived(data)
        elif event == "INTERACTION_CREATE":  # a button press (MESSAGE_COMPONENT), or something unknown
            self._press_arrived(data)
        elif event == "MESSAGE_CREATE":
            self._queue.put_nowait((str(event), data))

    def _command_arrived(self, interaction: dict[str, Any]) -> None:
        """A slash command, answered at once (Discord waits 3 seconds, the queue may take longer):
        help, a refusal or an unknown command with its text; ``/new`` and ``/stop`` with a
        deferred response, and queued, to be handled in order and answered by an edit."""
        parts = _interaction_parts(interaction)
        if parts is None:
            return
        interaction_id, token, user_id = parts
        name = _field(interaction.get("data"), "name")
        channel = _command_channel(interaction)
        if user_id is None or user_id not in self.allow:
            log.warning(
                "refused the command /%s from Discord user %s in channel %s: not on the allow-list",
                str(name)[:40],
                user_id,
                channel,
            )
            text = REFUSAL.format(user_id) if user_id is not None else "Sorry, this bot is private."
        elif name == "help":
            text = HELP
        elif name not in ("new", "stop") or channel is None:
            text = "Unknown command."
        else:
            # (the flag is the deferral's: what /stop says is for the user, what /new says for all)
            body: dict[str, Any] = {"type": DEFERRED} | ({"data": {"flags": EPHEMERAL}} if name == "stop" else {})
            ack = self._answer_soon(self._respond(interaction_id, token, body))
            self._queue.put_nowait((COMMAND, {"interaction": interaction, "ack": ack}))
            return
        self._answer_soon(self._reply(interaction_id, token, text))

    def _press_arrived(self, interaction: dict[str, Any]) -> None:
        """A button press, acknowledged at once (Discord waits 3 seconds, the queue may take
        longer): a stranger's, or an unknown button, refused with a note; an approval answer with a
        deferred update (type 6), and queued, to be decided in order and shown by an edit."""
        parts = _interaction_parts(interaction)
        if parts is None:
            return
        interaction_id, token, user_id = parts
        if user_id is None or user_id not in self.allow:
            log.warning("refused an approval answer from Discord user %s: not on the allow-list", user_id)
            self._answer_soon(self._reply(interaction_id, token, "You are not allowed to answer this."))
            return
        if interaction.get("type") != 3 or parse_callback(_field(interaction.get("data"), "custom_id")) is None:
            self._answer_soon(self._reply(interaction_id, token, "Unknown button."))
            return
        channel = _snowflake(interaction.get("channel_id"))
        request_id = cast("tuple[str, str]", parse_callback(_field(interaction.get("data"), "custom_id")))[1]
        ack = self._answer_soon(self._acknowledge_press(interaction_id, token, channel, request_id))
        self._queue.put_nowait((PRESS, {"interaction": interaction, "ack": ack}))

    async def _acknowledge_press(
        self, interaction_id: int, token: str, channel: int | None, request_id: str
    ) -> bool | None:
        """A press's answer on arrival: a note when its request is no longer pending (None), else
        a deferred update: whether it was taken."""
        if not await self._may_be_pending(channel, request_id):
            await self._reply(interaction_id, token, NOT_PENDING)
            return None
        return await self._respond(interaction_id, token, {"type": DEFERRED_UPDATE})

    async def _may_be_pending(self, channel: int | None, request_id: str) -> bool:
        """Whether ``request_id`` may be waiting for an answer in ``channel``: not when it is none of
        its process's pending requests (in doubt, the press is decided in its turn)."""
        if channel is None:
            return False
        pid = self._chats.get(channel)
        if pid is None:
            return True  # (a process made by what is before it in the queue)
        try:
            return await self._waits_for(await self.kernel.process(pid), request_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # (unknown: the store unreachable for a moment …)
            return True

    def _answer_soon(self, answer: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(answer, name="agentloop-discord-answer")
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)
        return task

    async def _register_commands(self) -> None:
        """Make ``COMMANDS`` the application's global commands: read what is registered, and
        overwrite it in one ``PUT`` only when it differs. A failure is logged, no more: the ``!``
        commands do without."""
        path = f"/applications/{self.application_id}/commands"
        try:
            registered = await self.api.request("GET", path, attempts=3)
            if not commands_differ(registered):
                log.info("the Discord slash commands /new, /stop and /help are registered already")
                return
            await self.api.request("PUT", path, json=list(COMMANDS), attempts=3)
            log.info("registered the Discord slash commands /new, /stop and /help")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # (DiscordError; anything else is a bug, which must not stop the bridge either)
            reason = self.redact(str(exc) if isinstance(exc, DiscordError) else f"{type(exc).__name__}: {exc}")
            log.warning("%s: the slash commands are not registered (!new, !stop and !help still work)", reason)

    # -- from Discord ----------------------------------------------------------------------------

    async def _intake(self) -> None:
        """Handle the dispatches one at a time, in order (apart from the connection, whose
        heartbeat ACKs must be read while a message is handled)."""
        while True:
            kind, data = await self._queue.get()
            await self._take(kind, data)

    async def _take(self, kind: str, data: dict[str, Any]) -> None:
        """Handle one dispatch (or a catch-up). When handling failed (the store was unreachable for
        a moment …) it is taken again, up to ``TRIES`` times in all, then skipped (a message that
        breaks the bridge must not hold up the rest for ever). A message taken again is admitted
        once, by its run id. A catch-up given up is queued again later (``_catch_up_given_up``)."""
        delay = self.api.backoff[0]
        for tried in range(1, TRIES + 1):
            try:
                async with self._lock("intake"):
                    if kind == CATCH_UP:
                        await self._catch_up(retry=data.get("retry") is True)
                    elif kind == "MESSAGE_CREATE":
                        await self._on_message(data)
                    elif kind == COMMAND:
                        await self._on_command(data["interaction"], data["ack"])
                    else:
                        await self._on_press(data["interaction"], data["ack"])
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = self.redact(f"{type(exc).__name__}: {exc}")
                what = (
                    "catching up"
                    if kind == CATCH_UP
                    else f"Discord {kind} {_field(data.get('interaction', data), 'id')}"
                )
                if tried == TRIES:
                    if kind == CATCH_UP:
                        self._catch_up_given_up(reason)
                        return
                    log.error("%s failed: %s; skipped after %d tries", what, reason, tried)
                    if kind in (COMMAND, PRESS):
                        await self._given_up(kind, data)
                    return
                log.error("%s failed (%s): trying again in %.1f s", what, reason, delay)
            await asyncio.sleep(delay)
            delay = min(max(delay * 2, 0.05), self.api.backoff[1])

    def _catch_up_given_up(self, reason: str) -> None:
        """A catch-up failed ``TRIES`` times: the channels it did not finish stay behind (their
        marks where it stopped, so what it did not read is not passed over by a live message) and
        it is queued again after a wait, doubled at each give-up (a new session catches up too)."""
        longest = self.api.backoff[1]
        self._retry_wait = min(max(self._retry_wait * 2, longest), max(RETRY_MOST, longest))
        log.error(
            "catching up failed: %s; catching up given up after %d tries: channels %s keep their marks, "
            "tried again in %.1f s",
            reason,
            TRIES,
            ", ".join(map(str, sorted(self._behind))) or "none",
            self._retry_wait,
        )
        if self._retry is None or self._retry.done():
            self._retry = asyncio.create_task(self._catch_up_later(self._retry_wait), name="agentloop-discord-retry")

    async def _catch_up_later(self, wait: float) -> None:
        await asyncio.sleep(wait)
        self._queue.put_nowait((CATCH_UP, {"retry": True}))

    async def _catch_up(self, *, retry: bool = False) -> None:
        """Handle, oldest first, what was said in the known channels after their marks (the
        gateway does not replay it to a new session); a ``retry`` of a catch-up given up, only in
        the channels it did not finish."""
        if not retry:
            self._behind = set(self.state.last)
        elif self._behind:
            log.info(
                "catching up again in channels %s, after a catch-up given up", ", ".join(map(str, sorted(self._behind)))
            )
        for channel in sorted(self._behind):
            await self._catch_up_channel(channel)
        if self._retry_wait:
            log.info("caught up after the catch-up given up: the channels' marks move again")
            self._retry_wait = 0.0

    async def _catch_up_channel(self, channel: int) -> None:
        """Catch up one channel. Each page read moves its mark over it once it is all dealt with,
        in one write: what needed nothing is not read again."""
        after = self.state.last.get(channel)
        taken = 0
        guild: object = None
        while after is not None:
            try:
                if not taken:  # (a REST message has no guild_id: the channel says whose it is)
                    guild = _field(await self.api.request("GET", f"/channels/{channel}", attempts=3), "guild_id")
                params = {"after": after, "limit": PAGE}
                batch = await self.api.request("GET", f"/channels/{channel}/messages", params=params, attempts=3)
            except DiscordError as exc:
                if exc.status not in (403, 404):
                    raise  # (taken again)
                log.warning("%s: channel %d is not caught up, and forgotten", exc, channel)
                self.state.forget(channel)
                self._handled.pop(channel, None)
                await self.state.save()
                break
            messages = [m for m in batch if _snowflake(_field(m, "id")) is not None] if isinstance(batch, list) else []
            messages.sort(key=lambda m: cast("int", _snowflake(m["id"])))
            for message in messages:
                await self._on_message(message if guild is None else {**message, "guild_id": guild}, caught_up=True)
            taken += len(messages)
            if messages:  # (each handled or passed over: a message that failed raised before this)
                self.state.passed(channel, cast("int", _snowflake(messages[-1]["id"])))
            self._settle(channel, done=len(messages) < PAGE)
            if self.state.unsaved:
                await self.state.save()
            if len(messages) < PAGE:
                break
            after = _snowflake(messages[-1]["id"])
        self._behind.discard(channel)
        if taken:
            log.info("caught up %d messages in channel %d", taken, channel)

    def _settle(self, channel: int, *, done: bool) -> None:
        """The messages handled live past the mark that the catch-up has now passed: they count
        as handled (a dispatch of one again is taken once) and are written with the page."""
        newest = self.state.settle(channel, done=done)
        if newest:
            self._handled[channel] = max(newest, self._handled.get(channel, 0))
            self.state.unsaved = max(self.state.unsaved, 1)

    async def _on_message(self, message: dict[str, Any], *, caught_up: bool = False) -> None:
        channel = _snowflake(message.get("channel_id"))
        message_id = _snowflake(message.get("id"))
        if channel is None or message_id is None:
            return
        if message_id <= self._handled.get(channel, 0) or message_id in self.state.taken.get(channel, ()):
            return  # handled already (caught up, then dispatched too; or dispatched, then caught up)
        if not await self._take_message(channel, message_id, message):
            await self._pass(channel, message_id)
        elif channel in self._behind and not caught_up:
            self.state.took(channel, message_id)  # (the mark stays: what came before is not read yet)
            await self.state.save()
        else:
            self._handled[channel] = max(message_id, self._handled.get(channel, 0))
            self.state.handled(channel, message_id)
            await self.state.save()

    async def _pass(self, channel: int, message_id: int) -> None:
        """A dispatched message that needed nothing moves its channel's mark, written every
        ``PAGE`` of them (a crash costs the next catch-up a page at most); not in a channel still
        to be caught up, whose mark would leap over what was said before."""
        if channel in self._behind or not self.state.passed(channel, message_id):
            return
        if self.state.unsaved >= PAGE:
            await self.state.save()

    async def _take_message(self, channel: int, message_id: int, message: dict[str, Any]) -> bool:
        """Act on the message: whether it was handled (its id then written at once); False for one
        that needs nothing (a stranger's, once refused, too)."""
        author = message.get("author")
        user_id = _snowflake(_field(author, "id"))
        if user_id is None:
            return False
        if _field(author, "bot") is True or user_id == self.bot_id or message.get("webhook_id") is not None:
            return False
        if message.get("type", 0) not in _TEXT_TYPES:
            return False
        text = message.get("content")
        text = text if isinstance(text, str) else ""
        roles = await self._roles_mentioned(message) if message.get("guild_id") is not None else frozenset()
        if message.get("guild_id") is not None and not self._mentioned(message) and not roles:
            return False  # in a server channel, what does not mention the bot (or its role) is not for it
        text = self._without_mentions(text, roles)
        if user_id not in self.allow:
            await self._refuse(channel, user_id)
            return False
        run_id = f"discord-{self.bot_id}-{channel}-{message_id}"  # a message taken again is admitted once
        attachments = self._attachments(message)
        forwarded = _forwarded(message) if not text.strip() and not attachments else None
        if forwarded is not None:  # (what it holds is the forwarded message's: not a command of the user's)
            content = forwarded.get("content")
            text = content.strip() if isinstance(content, str) else ""
            attachments = self._attachments(forwarded)
        command = self._command(text) if not attachments and forwarded is None else None
        if attachments:
            await self._deliver_files(channel, user_id, text, run_id, attachments, origin=speaker(message, user_id))
        elif command == "help":
            await self._send(channel, HELP)
        elif command == "new":
            await self._reset(channel)
        elif command == "stop":
            await self._stop(channel)
        elif not text.strip():
            await self._send(channel, HELP)
        else:
            await self._deliver(channel, user_id, text, run_id, origin=speaker(message, user_id))
        return True

    def _attachments(self, message: dict[str, Any]) -> list[Attachment]:
        """The message's files (a sticker, and without a transcriber a voice message's audio, as
        files the kernel does not take; a video as one to note, ``ChatBridge._classify``)."""
        found: list[Attachment] = []
        if message.get("sticker_items"):
            found.append(Attachment(None, "", "", "the sticker", None, ""))
        attachments = message.get("attachments")
        for item in attachments if isinstance(attachments, list) else []:
            if not isinstance(item, dict):
                continue
            name = shown_name(item.get("filename"), "")
            kind, mime = self._classify(item.get("content_type"), name)
            size = _int(item.get("size"))
            url = item.get("url")
            url = url if isinstance(url, str) else ""
            voice = kind == "audio" and ("waveform" in item or bool((_int(message.get("flags")) or 0) & _VOICE_MESSAGE))
            shown = "the voice message" if voice else name or "the attachment"
            found.append(Attachment(kind, mime, name, shown, size, url))
        return found

    async def _fetch(self, attachment: Attachment, cap: int) -> bytes:
        """The attachment from the CDN (no token): only from ``attachment_urls``."""
        url = attachment.ref
        if not _allowed(url, self.attachment_urls):
            shown = redact_url(url)[:200] if url else "none"
            raise FetchFailed(f"the attachment's address is not Discord's CDN ({shown}): not fetched", transient=False)
        request = self._files.build_request("GET", url, headers={"Accept-Encoding": "identity"})
        return await fetch(self._files, request, cap, self.redact)

    def _mentioned(self, message: dict[str, Any]) -> bool:
        mentions = message.get("mentions")
        return isinstance(mentions, list) and any(_snowflake(_field(m, "id")) == self.bot_id for m in mentions)

    async def _roles_mentioned(self, message: dict[str, Any]) -> frozenset[int]:
        """The bot's own roles a server message mentions (``mention_roles``): a user who picks the
        bot's role from the mention autocomplete means the bot."""
        listed = message.get("mention_roles")
        mentioned = {r for r in (_snowflake(x) for x in (listed if isinstance(listed, list) else [])) if r is not None}
        guild = _snowflake(message.get("guild_id"))
        if not mentioned or guild is None:
            return frozenset()
        return (await self._guild_roles(guild, mentioned)).mine & mentioned

    async def _guild_roles(self, guild: int, wanted: set[int]) -> GuildRoles:
        """The server's roles: as known, unless ``wanted`` holds one not among them (a role made
        since, the bot invited again), then read anew (at most every ``ROLES_REFRESH`` seconds). A
        server that refuses (403, 404) leaves the roles as they were; a transient failure is raised,
        and the message taken again."""
        now = asyncio.get_running_loop().time()
        known = self._roles.get(guild)
        if known is not None and (wanted <= known.known or now - known.at < ROLES_REFRESH):
            return known
        try:
            answer = await self.api.request("GET", f"/guilds/{guild}/roles", attempts=3)
        except DiscordError as exc:
            if exc.transient:
                raise
            log.info("%s: the roles of server %d are not known", exc, guild)
            kept = known or GuildRoles(frozenset(), frozenset(), now)
            self._roles[guild] = GuildRoles(kept.known, kept.mine, now)
            return self._roles[guild]
        self._roles[guild] = GuildRoles(*bot_roles(answer, self.bot_id), now)
        return self._roles[guild]

    def _without_mentions(self, text: str, roles: frozenset[int]) -> str:
        """``text`` with the bot's mentions (and those of its ``roles``) taken out."""
        stripped = self._mention.sub(" ", text)
        if roles:
            ids = "|".join(str(r) for r in sorted(roles))
            stripped = re.sub(rf"\s*<@&(?:{ids})>\s*", " ", stripped)
        return stripped.strip() if stripped != text else text

    def _command(self, text: str) -> str | None:
        """``new`` for "!new" (any case); None for text and for other words after a "!"."""
        if not text.startswith("!"):
            return None
        name = text[1:].split(maxsplit=1)[0].lower() if text[1:].strip() else ""
        return name if name in ("help", "new", "stop") else None

    async def _refuse(self, channel: int, user_id: int) -> None:
        if not self._refused.due((channel, user_id)):
            log.debug("refused another message from Discord user %d in channel %d", user_id, channel)
            return
        log.warning("refused a message from Discord user %d in channel %d: not on the allow-list", user_id, channel)
        await self._send(channel, REFUSAL.format(user_id))

    async def _on_press(self, interaction: dict[str, Any], ack: asyncio.Task[bool | None]) -> None:
        """An approval answer (from a user on the allow-list, a button of ours, its update deferred
        on arrival: ``ack`` says whether that was taken, None when the press was answered already,
        its request no longer pending), in its turn: decided, and the pressed
        message edited to show the outcome without its buttons (else updated in the response, as
        when nothing was deferred, or the outcome told in the channel)."""
        interaction_id, token, user_id = cast("tuple[int, str, int | None]", _interaction_parts(interaction))
        key, request_id = cast("tuple[str, str]", parse_callback(_field(interaction.get("data"), "custom_id")))
        channel = _snowflake(interaction.get("channel_id"))
        acked = await self._taken(ack)
        if acked is None:  # (no longer pending when it came: told so then)
            return
        outcome = await self._decide(channel, key, request_id)
        if outcome == NOT_PENDING or channel is None:
            if not acked:
                await self._reply(interaction_id, token, outcome)
            elif not await self._follow_up(interaction, outcome):  # (answered while it waited its turn)
                log.info("a press by Discord user %s on request %s came after it was answered", user_id, request_id)
            return
        presser = _field(interaction.get("member"), "user") or interaction.get("user")
        who = _field(presser, "global_name") or _field(presser, "username") or str(user_id)
        suffix = f"\n\n{outcome} by {who}"
        text = str(_field(interaction.get("message"), "content") or "")
        if len(text) + len(suffix) > MAX_MESSAGE:
            text = text[: max(MAX_MESSAGE - len(suffix) - 1, 0)] + "…"
        content = (text + suffix)[:MAX_MESSAGE]
        shown = False
        if not acked:  # (the deferral was not taken: the response updates the message, as it did)
            update = {"content": content, "components": [], "allowed_mentions": NO_MENTIONS}
            shown = await self._respond(interaction_id, token, {"type": 7, "data": update})  # UPDATE_MESSAGE
        # (an update refused too: the deferral may have been taken though its answer was lost, else
        # the token is void, a press replayed after a resume: the outcome is told in the channel)
        if not shown and not await self._edit_response(interaction, content, components=[]):
            await self._send(channel, suffix.strip())  # (the message keeps its buttons: the outcome is told)
        if outcome == OUTCOMES[key] and key != "d":
            await self._typing(channel)  # the run goes on

    async def _on_command(self, interaction: dict[str, Any], ack: asyncio.Task[bool]) -> None:
        """``/new`` or ``/stop`` (from a user on the allow-list, its response deferred on arrival:
        ``ack`` says whether that was taken), in its turn: what its ``!`` twin does, answered by
        editing the deferred response, else (for what was said) in the channel."""
        channel = cast("int", _command_channel(interaction))
        said: list[str] = []
        self._saying = (asyncio.current_task(), channel, said)
        try:
            await (self._reset(channel) if _field(interaction.get("data"), "name") == "new" else self._stop(channel))
        finally:
            self._saying = None
        acked = await self._taken(ack)
        text = split_message("\n".join(said), MAX_MESSAGE)[0] if said else "Stopping the answer under way."
        if acked and await self._edit_response(interaction, text):
            return
        if said:  # (the token was void, or the edit refused: told in the channel; "Stopped." comes anyway)
            await self._send(channel, "\n".join(said))

    @staticmethod
    async def _taken(ack: asyncio.Task[T]) -> T | bool:
        """What an interaction's acknowledgement on arrival says (whether it was taken …)."""
        try:
            return await asyncio.shield(ack)
        except asyncio.CancelledError:
            raise
        except Exception:  # (a bug in answering: taken as not acknowledged)
            return False

    def _application(self, interaction: dict[str, Any]) -> int | None:
        return _snowflake(interaction.get("application_id")) or self.application_id or self.bot_id

    async def _edit_response(
        self, interaction: dict[str, Any], text: str, *, components: list[dict[str, Any]] | None = None
    ) -> bool:
        """Whether the interaction's deferred response (a press's: the pressed message) now says
        ``text`` (with ``components``, when given)."""
        data: dict[str, Any] = {"content": text, "allowed_mentions": NO_MENTIONS}
        if components is not None:
            data["components"] = components
        path = f"/webhooks/{self._application(interaction)}/{MASK}/messages/@original"
        return await self._interaction_call("PATCH", path, data, str(interaction["token"]))

    async def _follow_up(self, interaction: dict[str, Any], text: str) -> bool:
        """Whether a note only the user sees was added to the interaction (a followup message,
        ``POST /webhooks/<application>/<token>``: its response was given already). The token is
        the address's path secret, as in a callback's: it reaches no log and no message."""
        data = {"content": text, "flags": EPHEMERAL, "allowed_mentions": NO_MENTIONS}
        path = f"/webhooks/{self._application(interaction)}/{MASK}"
        return await self._interaction_call("POST", path, data, str(interaction["token"]))

    async def _given_up(self, kind: str, data: dict[str, Any]) -> None:
        """Tell the user of a slash command or a press whose handling was given up: its deferred
        response would otherwise say "thinking…" until Discord drops it, 15 minutes on (a press:
        nothing at all)."""
        ack = data.get("ack")
        if not isinstance(ack, asyncio.Task) or await self._taken(ack) is not True:
            return  # (not deferred: nothing waits for an answer)
        if kind == COMMAND:
            await self._edit_response(data["interaction"], GIVEN_UP)
        else:
            await self._follow_up(data["interaction"], GIVEN_UP)

    async def _say(self, chat: int, text: str) -> None:
        """A notice in answer to the user: to the slash command being handled, when it is for its
        channel (and said by the task handling it); else to the channel."""
        saying = self._saying
        if saying is not None and saying[0] is asyncio.current_task() and saying[1] == chat:
            saying[2].append(text)
            return
        await self._send(chat, text)

    async def _reply(self, interaction_id: int, token: str, text: str) -> bool:
        """Answer a press (or a command) with a note only the user sees: whether it was taken."""
        data = {"content": text, "flags": EPHEMERAL, "allowed_mentions": NO_MENTIONS}
        return await self._respond(interaction_id, token, {"type": 4, "data": data})  # CHANNEL_MESSAGE_WITH_SOURCE

    async def _respond(self, interaction_id: int, token: str, body: dict[str, Any]) -> bool:
        """Whether the interaction's response was taken."""
        return await self._interaction_call("POST", f"/interactions/{interaction_id}/{MASK}/callback", body, token)

    async def _interaction_call(self, method: str, path: str, body: dict[str, Any], token: str) -> bool:
        """Whether Discord took ``body`` at an interaction's ``path`` (its ``token`` the path's
        secret, kept out of every log line). A refusal is logged, not raised: every caller has a
        way left to tell the user (15 minutes after the interaction, or 3 s unanswered, its token
        is void, and the channel is told instead)."""
        try:
            await self.api.request(method, path, json=body, attempts=3, path_secret=token)
        except DiscordError as exc:
            log.info("%s", exc)
            return False
        return True

    # -- to Discord ------------------------------------------------------------------------------

    async def _send_approval(self, chat: int, payload: Mapping[str, Any], request_id: str) -> None:
        components = approval_components(request_id)
        if components is not None:
            await self._send(chat, describe_request(payload, max_arguments=1500), components)

    def _where(self, chat: int) -> str:
        return f"the Discord channel {chat}"

    async def _send(self, chat: int, text: str, components: list[dict[str, Any]] | None = None) -> Undelivered | None:
        """``text`` to the channel, in as many messages as it takes (the buttons on the last), no
        one pinged. Transient failures are retried until they pass (a nonce keeps a retry after a
        lost answer from posting twice); a permanent one (the channel is gone, the bot may not
        write there) is logged, and the text dropped (``Undelivered``)."""
        parts = split_message(text, MAX_MESSAGE)
        for n, part in enumerate(parts):
            body: dict[str, Any] = {"content": part, "allowed_mentions": NO_MENTIONS}
            body |= {"nonce": secrets.token_hex(12), "enforce_nonce": True}
            if components is not None and n == len(parts) - 1:
                body["components"] = components
            try:
                await self.api.request("POST", f"/channels/{chat}/messages", json=body)
            except DiscordError as exc:
                log.error("%s (channel %d): the message is dropped", exc, chat)
                return Undelivered(str(exc), n, len(parts))
        return None

    async def _typing(self, chat: int) -> None:
        try:
            await self.api.request("POST", f"/channels/{chat}/typing", attempts=1)
        except DiscordError as exc:
            log.info("%s", exc)
