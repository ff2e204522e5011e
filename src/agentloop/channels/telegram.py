"""Talk to a durable agent from Telegram.

    async with Kernel.open(...) as kernel, TelegramBridge(kernel, token, allow=[12345]) as bridge:
        await bridge.wait()  # until cancelled

``TelegramBridge`` long-polls the Bot API's ``getUpdates`` and keeps one durable process per
Telegram chat. A text message becomes ``Process.send`` (mode ``queue``: while the agent is still
answering, the message waits for its own run instead of being lost or folded into the one under
way); ``/new`` resets the conversation and ``/stop`` aborts the run. A follower per process reads
its signals: ``proc.run.started`` shows "typing…", ``proc.run.hil.requested`` sends the call to
approve with Approve / Deny / Always buttons (answered through ``callback_query`` updates and
``Process.hil``), and ``proc.run.finished`` sends the answer as plain text, in parts of at most
4096 characters (no ``parse_mode``: nothing the model writes needs escaping, nothing is lost).

A photo (the largest size Telegram offers within the limit) or a document (a PDF, a plain text,
Markdown or CSV file, an image sent as a file) becomes the same ``Process.send`` with the file
attached and its caption as the text: the file is found with ``getFile`` and downloaded from
``/file/bot<token>/<file path>`` (the token kept out of every log line and error, as for the
methods: ``agentloop.channels.botapi``). A voice message or an audio file (a ``voice``, an
``audio``, or a document of an audio type) is taken only when the bridge has a ``transcriber``: it
is downloaded the same way and reaches the agent as its transcript, marked as such, after the
caption; a transcription that fails is told to the user. A video (a ``video``, a round
``video_note``, an ``animation``: Telegram's GIF, which it turns into a silent MP4; or a document
of a video type) reaches the agent as a note of what was attached (its name, type and size, from the
message itself: nothing is downloaded), after the caption. Without a transcriber voice messages and
audio, and always stickers and other files, are refused with a short reply, and so are files past
``max_file_bytes``; a download that keeps failing is reported to the user and nothing of that
message is delivered (``agentloop.channels.media``). An album (Telegram sends one message per file, sharing a
``media_group_id``) is one input: its files together (at most ``media.MAX_FILES`` to an input),
with the caption one of them carries. A poll whose last update is inside an album waits a moment
(``ALBUM_WAIT``) for the album's other files before it takes it.

Only the Telegram users on the allow-list reach a process: anyone else gets a short refusal
(with their user id, so the bot's owner can add them) and their message goes nowhere. An empty
allow-list refuses everyone.

A service message (Telegram's note that a member joined, a message was pinned, the auto-delete timer
was set …) was written by nobody: it is not answered, nor refused. When a group becomes a
supergroup its chat id changes (Telegram says so in a service message, and in the error a send to
the old id gets): the group's process goes on with the new id, and what was on its way is sent there.

In a supergroup with topics (a forum), each topic is a conversation of its own: a message written in
a topic (``is_topic_message``, its ``message_thread_id``) reaches that topic's process, and what the
bridge sends for it (answers, "typing…", approvals, refusals) goes into that topic. The General
topic, and every chat without topics, is one conversation per chat, as before.

What survives a restart:

- the chat's process: it is spawned with the process kv ``telegram.chat`` = ``<bot id>:<chat id>``
  (a topic's: ``<bot id>:<chat id>:<thread id>``; in the same transaction), and found again by that key;
- the ``getUpdates`` offset and, per process, the last signal acted on: a small JSON file,
  ``<data dir>/var/telegram/<bot id>.json``. The store has no table for state that belongs to no
  process, and the offset belongs to the bot. The offset advances only after an update was handled,
  so a crash in between delivers the update again, once: its input is sent with the run id
  ``telegram-<bot>-<chat>-<update id>``, which ``Process.send`` admits only once (Telegram numbers
  updates afresh, from a random id, after a week without any: a poll whose updates are all below
  the offset moves it back to them). A follower resumes
  from its last signal, so an answer that finished while the bridge was down is still sent (one
  sent just before a crash may be sent twice: at least once, never lost).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, cast

import httpx

from agentloop.channels.botapi import DEFAULT_API_URL, BotApi, BotApiError
from agentloop.channels.bridge import NOT_PENDING, OUTCOMES, ChatBridge, RefusalThrottle, Undelivered
from agentloop.channels.media import (
    MAX_FILE_BYTES,
    MAX_FILES,
    UNSUPPORTED,
    Attachment,
    FetchFailed,
    TooLarge,
    Transcriber,
    audio_type,
    classify,
    shown_name,
    video_attachment,
)
from agentloop.channels.state import ChannelState
from agentloop.channels.telegram_text import approval_keyboard, describe_request, parse_callback, split_message
from agentloop.kernel import Kernel, NoSuchProcess
from agentloop.messages import Origin, origin
from agentloop.process.archive import check_name

log = logging.getLogger("agentloop.channels.telegram")

CHAT_KEY = "telegram.chat"  # process kv: "<bot id>:<chat id>[:<thread id>]" of its chat (topic)
TRIES = 5  # times an update whose handling fails is taken before it is skipped
GENERAL_TOPIC = 1  # the thread id of a forum's General topic, which a send must not name
ALBUM_WAIT = 0.5  # seconds a poll that ends inside an album waits for the album's other files
# what a message may hold that the kernel does not take
_UNSUPPORTED = {
    "voice": "the voice message",
    "audio": "the audio file",
    "sticker": "the sticker",
}
# videos, given as a note (looked for before "document": an animation comes with a "document" of the
# same file beside it, for clients that know no animations): what the user is told of each
_VIDEO = {"video": "the video", "video_note": "the video message", "animation": "the animation"}
_AUDIO = {"voice": ("the voice message", "audio/ogg"), "audio": ("the audio file", "audio/mpeg")}  # (its default type)
# what a service message holds (Telegram's note that something happened in the chat: a member
# joined, a message was pinned, the auto-delete timer was set, the group became a supergroup …):
# nobody wrote it to the bot, so it is not answered (nor refused) and reaches no process
_SERVICE = frozenset(
    {
        "new_chat_members",
        "left_chat_member",
        "new_chat_title",
        "new_chat_photo",
        "delete_chat_photo",
        "group_chat_created",
        "supergroup_chat_created",
        "channel_chat_created",
        "message_auto_delete_timer_changed",
        "migrate_to_chat_id",
        "migrate_from_chat_id",
        "pinned_message",
        "successful_payment",
        "refunded_payment",
        "users_shared",
        "chat_shared",
        "gift",
        "unique_gift",
        "connected_website",
        "write_access_allowed",
        "passport_data",
        "proximity_alert_triggered",
        "boost_added",
        "chat_background_set",
        "checklist_tasks_done",
        "checklist_tasks_added",
        "direct_message_price_changed",
        "forum_topic_created",
        "forum_topic_edited",
        "forum_topic_closed",
        "forum_topic_reopened",
        "general_forum_topic_hidden",
        "general_forum_topic_unhidden",
        "giveaway_created",
        "giveaway_completed",
        "paid_message_price_changed",
        "video_chat_scheduled",
        "video_chat_started",
        "video_chat_ended",
        "video_chat_participants_invited",
    }
)

HELP = (
    "Send me a message and your agent answers here.\n"
    "/new starts a fresh conversation.\n"
    "/stop stops the answer under way."
)
CONTEXT = (
    "The user talks with you through Telegram, which shows your answers as plain text: "
    "write without Markdown formatting."
)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _field(value: object, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else None


class Topic(NamedTuple):
    """One topic of a forum supergroup, a conversation of its own. A chat without topics (and a
    forum's General topic) is keyed by its chat id alone, as before topics were kept apart, so
    that the processes of existing chats are found again under the keys they were spawned with."""

    chat: int
    thread: int


Chat = int | Topic  # a conversation: a chat (by its id), or one topic of a forum


def chat_id_of(chat: Chat) -> int:
    """The Telegram chat id of a conversation."""
    return chat.chat if isinstance(chat, Topic) else chat


def conversation(message: object) -> Chat | None:
    """The conversation ``message`` belongs to: its topic when it was written in one (Telegram
    marks it ``is_topic_message``; a reply elsewhere also carries a ``message_thread_id``, which is
    no topic), else its chat. None for a message that names no chat. The General topic (thread
    ``GENERAL_TOPIC``) is the chat's, should a message in it come marked: a send naming that thread
    is refused ("message thread not found"); one naming none goes there."""
    chat_id = _int(_field(_field(message, "chat"), "id"))
    if chat_id is None:
        return None
    thread = _int(_field(message, "message_thread_id"))
    if _field(message, "is_topic_message") is True and thread is not None and thread != GENERAL_TOPIC:
        return Topic(chat_id, thread)
    return chat_id


def speaker(message: object, user_id: int) -> Origin:
    """Who wrote ``message`` (the user ``user_id``), as Telegram names them (first and last name,
    else the username), and whether in a private chat or a group's: in a group the model is told
    who speaks (``messages.Origin``)."""
    sender = _field(message, "from")
    parts = [_field(sender, "first_name"), _field(sender, "last_name")]
    name = " ".join(p.strip() for p in parts if isinstance(p, str) and p.strip())
    username = _field(sender, "username")
    if not name and isinstance(username, str):
        name = username
    private = _field(_field(message, "chat"), "type") == "private"
    return origin(name, f"telegram:{user_id}", "direct" if private else "group")


def _album(update: object) -> tuple[int, str] | None:
    """(chat id, media group id) of an update that is one file of an album."""
    message = _field(update, "message")
    chat, group = _int(_field(_field(message, "chat"), "id")), _field(message, "media_group_id")
    return (chat, group) if chat is not None and isinstance(group, str) else None


def takes(updates: list[Any]) -> list[list[Any]]:
    """The updates of one ``getUpdates``, in order, as they are taken: one by one, except the files
    of an album (consecutive messages of one chat with one ``media_group_id``), taken together as
    one input, ``MAX_FILES`` at most to a take."""
    out: list[list[Any]] = []
    for update in updates:
        album = _album(update)
        if album is not None and out and _album(out[-1][0]) == album and len(out[-1]) < MAX_FILES:
            out[-1].append(update)
        else:
            out.append([update])
    return out


class TelegramBridge(ChatBridge[Chat]):
    """Connects a Telegram bot to ``kernel``: see the module doc.

    ``allow`` are the Telegram user ids that may talk to the agent (and answer its approvals);
    ``api_url`` the Bot API server; ``account`` the account every chat's process belongs to
    (default: ``telegram-<user id>`` of the person who wrote first in the chat); ``context`` is
    given to each process at spawn; ``poll_timeout`` the seconds one ``getUpdates`` waits for news;
    ``state_dir`` where the state file is kept (default ``<data dir>/var/telegram``); ``backoff``
    the (first, longest) wait between retries; ``max_file_bytes`` the largest photo or document
    taken (``agentloop.channels.media``); ``transcriber`` turns voice messages and audio files into
    text (without one they are refused); ``transport`` replaces the network (tests)."""

    CHAT_KEY = CHAT_KEY
    OWNER_PREFIX = "telegram-"
    NAME = "telegram"
    APP = "Telegram"
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
        poll_timeout: int = 30,
        state_dir: str | Path | None = None,
        backoff: tuple[float, float] = (1.0, 30.0),
        max_file_bytes: int = MAX_FILE_BYTES,
        transcriber: Transcriber | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        allowed = list(allow)
        if any(_int(uid) is None for uid in allowed):
            raise TypeError("allow must be Telegram user ids (integers)")
        if account is not None:
            check_name(account, "account")
        if _int(poll_timeout) is None or not 0 <= poll_timeout <= 600:
            raise ValueError(f"poll_timeout must be whole seconds from 0 to 600, got {poll_timeout!r}")
        self.api = BotApi(token, api_url, backoff=backoff, timeout=30.0, transport=transport)
        self.state_dir = Path(state_dir) if state_dir is not None else kernel.data_dir / "var" / "telegram"
        state = ChannelState(self.state_dir / "unknown.json")
        super().__init__(
            kernel,
            account=account,
            context=context,
            state=state,
            backoff=self.api.backoff,
            max_file_bytes=max_file_bytes,
            transcriber=transcriber,
        )
        self.allow = frozenset(allowed)
        self.poll_timeout = poll_timeout
        self.bot_id = 0
        self.username = ""
        self._poller: asyncio.Task[None] | None = None
        self._refused: RefusalThrottle[int] = RefusalThrottle()
        self._failures: dict[int, int] = {}  # update id -> the times its handling failed (the one retried)
        # a group's chat id -> the supergroup's it became: what is sent to the group goes there
        self._moved: dict[int, int] = {}

    # -- life ------------------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        """Ask Telegram who the bot is (``getMe``; a refused token raises ``BotApiError``, an
        unreachable server too after a few tries), find the chats' processes again, follow them,
        and begin polling. Returns the bot (``id``, ``username`` …)."""
        try:
            me = await self.api.call("getMe", attempts=4)
            bot_id = _int(_field(me, "id"))
            if bot_id is None:
                raise BotApiError("getMe", "the answer names no bot")
            self.bot_id = bot_id
            self.username = str(_field(me, "username") or "")
            self.state = ChannelState(self.state_dir / f"{bot_id}.json")
            await asyncio.to_thread(self.state.load)
            await self._find_chats()
        except BaseException:
            await self.close()
            raise
        if not self.allow:
            log.warning("no Telegram user is allowed: every message is refused")
        self._poller = asyncio.create_task(self._poll(), name="agentloop-telegram-poll")
        return cast("dict[str, Any]", me)

    async def wait(self) -> None:
        """Until the poller ends (it ends only when cancelled, or closed)."""
        if self._poller is not None:
            await asyncio.gather(self._poller, return_exceptions=True)

    async def close(self) -> None:
        """Stop polling and following (before the kernel closes), and close the HTTP client. An
        update or a signal being handled is given ``bridge.CLOSE_GRACE`` seconds to finish first."""
        await self._stop_tasks({"poll": self._poller})  # (an update being handled holds "poll")
        self._poller = None
        await self.api.close()

    def _kv_value(self, chat: Chat) -> str:
        if isinstance(chat, Topic):
            return f"{self.bot_id}:{chat.chat}:{chat.thread}"
        return f"{self.bot_id}:{chat}"

    def _chat_of(self, value: str) -> Chat | None:
        bot, *ids = value.split(":")
        if bot != str(self.bot_id) or len(ids) not in (1, 2):
            return None
        try:
            numbers = [int(n) for n in ids]
        except ValueError:
            return None
        return Topic(numbers[0], numbers[1]) if len(numbers) == 2 else numbers[0]

    def redact(self, text: str) -> str:
        return self.api.redact(text)

    # -- from Telegram ---------------------------------------------------------------------------

    async def _poll(self) -> None:
        delay = self.api.backoff[0]
        waited_for = None  # the first update of an album a poll ended inside, left for the next
        while True:
            params: dict[str, Any] = {"offset": self.state.offset, "timeout": self.poll_timeout}
            params["allowed_updates"] = ["message", "callback_query"]
            try:
                updates = await self.api.call("getUpdates", params, http_timeout=self.poll_timeout + 15.0)
            except BotApiError as exc:  # permanent: a revoked token, another poller (409) …
                log.error("%s; trying again in %.0f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 0.05), self.api.backoff[1])
                continue
            except Exception as exc:  # (a bug: the bridge goes on all the same)
                log.error("Telegram getUpdates failed: %s", self.api.redact(f"{type(exc).__name__}: {exc}"))
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 0.05), self.api.backoff[1])
                continue
            if isinstance(updates, list):
                await self._renumbered(updates)
            before = self.state.offset
            failed = deferred = False
            if isinstance(updates, list):
                batch = takes(updates)
                last = batch[-1][0] if batch else None
                if _album(last) is not None and _field(last, "update_id") != waited_for:
                    # the album's other files may come with the next poll: the rest is taken now,
                    # the album after a moment (asked for from the offset, it comes again, with
                    # what followed it), and then whatever the poll brings of it
                    batch.pop()
                    deferred, waited_for = True, _field(last, "update_id")
                for take in batch:
                    async with self._lock("poll"):
                        failed = not await self._take(take)
                    if failed:  # (taken again, from the next getUpdates on: the later ones after it)
                        break
            else:
                log.warning("Telegram getUpdates answered something other than a list of updates")
            if failed or (updates != [] and self.state.offset == before and not deferred):  # not again at once
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 0.05), self.api.backoff[1])
            else:
                delay = self.api.backoff[0]
                if deferred:
                    await asyncio.sleep(ALBUM_WAIT)

    async def _renumbered(self, updates: list[Any]) -> None:
        """Follow Telegram when it numbers updates afresh: after a week without updates the next
        one's id is chosen at random, and may be below the offset. Telegram still gives it (an
        offset past every id it gave out confirms nothing), but it would be taken for one taken
        already: skipped, and given again, for ever, with every update after it. A poll whose
        updates are all below the offset therefore moves the offset back to the first of them."""
        ids = [i for i in (_int(_field(update, "update_id")) for update in updates) if i is not None]
        if not ids or max(ids) >= self.state.offset:
            return
        log.warning(
            "Telegram numbers its updates afresh (after a week without any): the offset goes from %d back to %d",
            self.state.offset,
            min(ids),
        )
        self.state.offset = min(ids)
        self.state.taking = None
        await self.state.save()

    async def _take(self, take: list[Any]) -> bool:
        """Handle one update (or an album's, as one: ``takes``), then move the offset past it. When
        handling failed (the store was unreachable for a moment …) the offset stays, and False says
        so: the update is taken again (its input is admitted once, by its run id: the first
        update's), up to ``TRIES`` times in all, then skipped (an update that breaks the bridge
        must not come back for ever)."""
        ids = [_int(_field(update, "update_id")) for update in take]
        if None in ids:
            log.warning("skipped a Telegram update without an update_id")
            return True
        fresh = [(i, u) for i, u in zip(cast("list[int]", ids), take, strict=True) if i >= self.state.offset]
        if not fresh:
            return True
        held = self.state.taking
        if held is not None and held[0] == fresh[0][0]:  # taken again: what it held the first time, no more
            fresh = [(i, u) for i, u in fresh if i <= held[1]]
        elif _album(fresh[0][1]) is not None:  # (its run id is the first update's: a retake must hold the same)
            self.state.taking = (fresh[0][0], fresh[-1][0])
            await self.state.save()
        update_id, last = fresh[0][0], fresh[-1][0]
        try:
            if len(fresh) == 1:
                await self._handle(cast("dict[str, Any]", fresh[0][1]), update_id)
            else:
                await self._on_album([u["message"] for _, u in fresh], update_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = self.api.redact(f"{type(exc).__name__}: {exc}")
            tries = self._failures.get(update_id, 0) + 1
            if tries < TRIES:
                self._failures = {update_id: tries}
                log.error("Telegram update %d was not handled (%s): it is taken again", update_id, reason)
                return False
            log.error("Telegram update %d was not handled: %s; skipped after %d tries", update_id, reason, tries)
        self._failures.pop(update_id, None)
        self.state.offset = last + 1
        self.state.taking = None
        await self.state.save()
        return True

    async def _handle(self, update: dict[str, Any], update_id: int) -> None:
        if isinstance(update.get("message"), dict):
            await self._on_message(update["message"], update_id)
        elif isinstance(update.get("callback_query"), dict):
            await self._on_callback(update["callback_query"])

    async def _sender(self, message: dict[str, Any]) -> tuple[Chat, int] | None:
        """(conversation, user id) of a message from a user on the allow-list; None (anyone else
        refused) otherwise."""
        chat = conversation(message)
        user_id = _int(_field(message.get("from"), "id"))
        if chat is None:
            return None
        if user_id is None or user_id not in self.allow:
            await self._refuse(chat, user_id)
            return None
        return chat, user_id

    def _run_id(self, chat: Chat, update_id: int) -> str:
        """The run id of an update's input: a redelivered update is admitted once (the chat id
        alone, a topic's too: the update id is the bot's own, unique across its chats)."""
        return f"telegram-{self.bot_id}-{chat_id_of(chat)}-{update_id}"

    async def _on_message(self, message: dict[str, Any], update_id: int) -> None:
        if not isinstance(message.get("text"), str) and not _SERVICE.isdisjoint(message):
            await self._on_service(message)
            return
        sender = await self._sender(message)
        if sender is None:
            return
        chat, user_id = sender
        run_id = self._run_id(chat, update_id)
        text = message.get("text")
        if not isinstance(text, str) or not text.strip():
            attachments = self._attachments(message)
            if not attachments:  # (a location, a contact, a poll …)
                await self._send(chat, UNSUPPORTED)
                return
            caption = message.get("caption")
            caption = caption if isinstance(caption, str) else ""
            await self._deliver_files(chat, user_id, caption, run_id, attachments, origin=speaker(message, user_id))
            return
        command = self._command(text)
        if command in ("start", "help"):
            await self._send(chat, HELP)
        elif command == "new":
            await self._reset(chat)
        elif command == "stop":
            await self._stop(chat)
        else:
            await self._deliver(chat, user_id, text, run_id, origin=speaker(message, user_id))

    async def _on_service(self, message: dict[str, Any]) -> None:
        """A service message: nothing to answer. One that says a group became a supergroup (which
        Telegram sends in both) moves the group's conversation to the supergroup's chat id."""
        chat_id = _int(_field(message.get("chat"), "id"))
        to, since = _int(message.get("migrate_to_chat_id")), _int(message.get("migrate_from_chat_id"))
        if chat_id is not None and to is not None:
            await self._migrate(chat_id, to)
        elif chat_id is not None and since is not None:
            await self._migrate(since, chat_id)
        else:
            log.debug("a Telegram service message in chat %s is not answered", chat_id)

    async def _migrate(self, old: int, new: int) -> None:
        """The group ``old`` is the supergroup ``new`` now (its chat id changed): what is sent to
        ``old`` goes to ``new``, and its process talks with ``new`` (its kv says so, for a restart)."""
        if old == new:
            return
        if self._moved.get(old) != new:
            self._moved[old] = new
            log.info("Telegram chat %d became the supergroup %d: its conversation goes on there", old, new)
        pid = self._chats.get(old)
        if pid is None or new in self._chats:
            return
        async with self.kernel.store.transaction():  # (first: a failure leaves it to be done again)
            await self.kernel.store.kv_set(pid, CHAT_KEY, self._kv_value(new))
        self._chats[new] = self._chats.pop(old)

    async def _on_album(self, messages: list[dict[str, Any]], update_id: int) -> None:
        """An album's messages (one file each, of one chat) as one input: all its files, the
        caption one of them carries as the text (``_on_message`` for the rest). A file the kernel
        does not take (an archive in an album of documents) is left out, and the user told so; a
        video goes with the photos, as its note."""
        sender = await self._sender(messages[0])
        if sender is None:
            return
        chat, user_id = sender
        found = [a for message in messages for a in self._attachments(message)]
        attachments = [a for a in found if a.kind is not None]
        if not attachments:
            await self._send(chat, UNSUPPORTED)
            return
        run_id = self._run_id(chat, update_id)
        left_out = [a.what for a in found if a.kind is None]  # (an archive beside PDFs: the PDFs go on)
        if left_out and not await self._admitted(chat, run_id):
            await self._send(chat, f"Left out of your album: {', '.join(left_out)}. {UNSUPPORTED}")
        captions = [m.get("caption") for m in messages]
        caption = next((c for c in captions if isinstance(c, str) and c.strip()), "")
        await self._deliver_files(chat, user_id, caption, run_id, attachments, origin=speaker(messages[0], user_id))

    def _attachments(self, message: dict[str, Any]) -> list[Attachment]:
        """The message's photo, document, video or (with a transcriber) audio (Telegram sends one a
        message), or what it holds that the kernel does not take; nothing for a message with no file."""
        if self.transcriber is not None:
            for key, (what, default) in _AUDIO.items():
                if isinstance(message.get(key), dict):
                    return [self._audio(message[key], what, default)]
        for key, what in _VIDEO.items():
            video = self._video(message.get(key), key, what)
            if video is not None:
                return [video]
        for key, what in _UNSUPPORTED.items():
            if key in message:
                return [Attachment(None, "", "", what, None, "")]
        photo = message.get("photo")
        if isinstance(photo, list) and photo:
            return [self._photo(photo)]
        document = message.get("document")
        if isinstance(document, dict):
            file_id = document.get("file_id")
            name = shown_name(document.get("file_name"), "")
            kind, mime = self._classify(document.get("mime_type"), name)
            size = _int(document.get("file_size"))
            ref = file_id if isinstance(file_id, str) else ""
            shown = name or ("the audio file" if kind == "audio" else "the document")
            return [Attachment(kind, mime, name, shown, size, ref)]
        return []

    def _audio(self, audio: dict[str, Any], what: str, default: str) -> Attachment:
        """A voice message or an audio file (``what``), of its declared type (else ``default``)."""
        file_id = audio.get("file_id")
        name = shown_name(audio.get("file_name"), "")
        mime = audio_type(audio.get("mime_type"), name) or default
        ref = file_id if isinstance(file_id, str) else ""
        return Attachment("audio", mime, name, what, _int(audio.get("file_size")), ref)

    def _video(self, video: object, key: str, what: str) -> Attachment | None:
        """A video (``what``: a ``video``, a ``video_note``, an ``animation``), from what the message
        says of it: its name, type and size, which is all its note needs (it is never downloaded).

        An animation is noted as the video it is, not shown by its thumbnail: Telegram keeps a GIF
        as a silent MP4, and the thumbnail is one small frame of it, which would have the agent
        describe a moving picture from a still it did not choose (and cost two requests). One kept
        as an image (a GIF as ``image/gif``) is None: the document beside it, an image the kernel
        takes, is used instead. A round ``video_note`` says no type, nor does a video that the
        sender gave none: Telegram's are MP4."""
        if not isinstance(video, dict):
            return None
        declared = video.get("mime_type")
        if key == "animation" and classify(declared)[0] == "image":
            return None
        file_id = video.get("file_id")
        ref = file_id if isinstance(file_id, str) else ""
        return video_attachment(declared, video.get("file_name"), what, _int(video.get("file_size")), ref)

    def _photo(self, sizes: list[Any]) -> Attachment:
        """The largest of a photo's sizes within the limit (the smallest, when none is: refused)."""
        known = [s for s in sizes if isinstance(_field(s, "file_id"), str)]
        if not known:
            return Attachment("image", "image/jpeg", "", "the photo", None, "")

        def area(size: Any) -> int:
            return (_int(_field(size, "width")) or 0) * (_int(_field(size, "height")) or 0)

        def fits(size: Any) -> bool:
            declared = _int(_field(size, "file_size"))
            return declared is None or declared <= self.max_file_bytes

        fitting = [s for s in known if fits(s)]
        best = max(fitting, key=area) if fitting else min(known, key=lambda s: _int(s.get("file_size")) or 0)
        return Attachment("image", "image/jpeg", "", "the photo", _int(best.get("file_size")), best["file_id"])

    async def _fetch(self, attachment: Attachment, cap: int) -> bytes:
        """``getFile``, then the file from ``/file/bot<token>/<file path>``."""
        if not attachment.ref:
            raise FetchFailed("the message names no file", transient=False)
        try:
            found = await self.api.call("getFile", {"file_id": attachment.ref}, attempts=1)
        except BotApiError as exc:
            if "too big" in exc.description.lower():  # (the Bot API gives bots files of up to 20 MB)
                raise TooLarge(exc.description) from None
            raise FetchFailed(str(exc), transient=exc.transient) from None
        size = _int(_field(found, "file_size"))
        if size is not None and size > cap:
            raise TooLarge(f"{size} bytes")
        return await self.api.download(_field(found, "file_path"), cap)

    async def _refuse(self, chat: Chat, user_id: int | None) -> None:
        """Tell a stranger the bot is private, in the topic they wrote in; at most once an hour per
        chat (not per topic: a forum's topics are one group of people)."""
        chat_id = chat_id_of(chat)
        if not self._refused.due(chat_id):
            log.debug("refused another message from Telegram user %s in chat %d", user_id, chat_id)
            return
        log.warning("refused a message from Telegram user %s in chat %d: not on the allow-list", user_id, chat_id)
        if user_id is not None:
            await self._send(chat, f"Sorry, this bot is private. (Your Telegram user id is {user_id}.)")

    def _command(self, text: str) -> str | None:
        """``new`` for "/new" or "/new@thisbot"; None for text and for another bot's command."""
        if not text.startswith("/"):
            return None
        name, _, bot = text.split(maxsplit=1)[0][1:].partition("@")
        if bot and bot.lower() != self.username.lower():
            return None
        return name.lower() if name.lower() in ("start", "help", "new", "stop") else None

    async def _on_callback(self, query: dict[str, Any]) -> None:
        query_id = query.get("id")
        if not isinstance(query_id, str):
            return
        user_id = _int(_field(query.get("from"), "id"))
        if user_id is None or user_id not in self.allow:
            log.warning("refused an approval answer from Telegram user %s: not on the allow-list", user_id)
            await self._answer(query_id, "You are not allowed to answer this.")
            return
        button = parse_callback(query.get("data"))
        if button is None:
            await self._answer(query_id, "Unknown button.")
            return
        key, request_id = button
        message = query.get("message")
        chat = where = conversation(message)  # (the approval's topic: the process that asked)
        if chat is not None and not isinstance(chat, Topic):
            if chat not in self._chats:  # (asked in a group that became a supergroup: its process talks there now)
                chat = self._moved.get(chat, chat)
            chat = await self._asking(chat, request_id)
        outcome = await self._decide(chat, key, request_id)
        decided = outcome == OUTCOMES[key]
        await self._answer(query_id, outcome)
        if where is not None:  # (edited where it is, in a group that has moved since too: see ``_settle``)
            await self._settle(chat_id_of(where), message, outcome, _field(query.get("from"), "first_name"))
        if decided and key != "d" and chat is not None:
            await self._typing(chat)  # the run goes on

    async def _asking(self, chat_id: int, request_id: str) -> Chat:
        """The conversation of the chat ``chat_id`` (the chat itself, or one of its topics) whose
        process waits for ``request_id``; the chat when none does. A press names its message's
        topic, except on a message Telegram no longer shows the bot (one too old: an
        ``InaccessibleMessage``, with its chat and id only), while an approval may wait for days."""
        for chat in [c for c in self._chats if isinstance(c, Topic) and c.chat == chat_id]:
            pid = self._chats.get(chat)
            if pid is None:
                continue
            try:
                if await self._waits_for(await self.kernel.process(pid), request_id):
                    return chat
            except NoSuchProcess:
                continue
        return chat_id

    async def _settle(self, chat_id: int, message: Any, outcome: str, who: object) -> None:
        """The approval message, its buttons taken away and what became of it added. Edited where
        it was sent, also after its group became a supergroup: the supergroup numbers its messages
        afresh, so the old message's id there would name another message (the edit may fail in
        the old group, which Telegram keeps read-only; the outcome was answered to the presser)."""
        message_id = _int(_field(message, "message_id"))
        if message_id is None:
            return
        text = _field(message, "text")
        by = f" by {who}" if isinstance(who, str) and who and outcome != NOT_PENDING else ""
        if isinstance(text, str) and text:
            params = {"chat_id": chat_id, "message_id": message_id, "text": f"{text}\n\n{outcome}{by}"}
            await self._try("editMessageText", params)
        else:
            params = {"chat_id": chat_id, "message_id": message_id, "reply_markup": {"inline_keyboard": []}}
            await self._try("editMessageReplyMarkup", params)

    # -- to Telegram -----------------------------------------------------------------------------

    async def _send_approval(self, chat: Chat, payload: Mapping[str, Any], request_id: str) -> None:
        keyboard = approval_keyboard(request_id)
        if keyboard is not None:
            await self._send(chat, describe_request(payload), keyboard)

    def _to(self, chat: Chat) -> dict[str, Any]:
        """Where a call for ``chat`` goes: its chat id (the supergroup's, for a group that became
        one), and its topic's ``message_thread_id`` (else Telegram puts it in the General topic)."""
        chat_id = chat_id_of(chat)
        params: dict[str, Any] = {"chat_id": self._moved.get(chat_id, chat_id)}
        if isinstance(chat, Topic):
            params["message_thread_id"] = chat.thread
        return params

    def _where(self, chat: Chat) -> str:
        if isinstance(chat, Topic):
            return f"topic {chat.thread} of the Telegram chat {chat.chat}"
        return f"the Telegram chat {chat}"

    async def _send(self, chat: Chat, text: str, markup: dict[str, Any] | None = None) -> Undelivered | None:
        """``text`` to the chat (its topic), in as many messages as it takes (the buttons on the
        last). Transient failures are retried until they pass; a permanent one (the user blocked
        the bot, the chat is gone) is logged, and the text dropped (``Undelivered``)."""
        parts = split_message(text)
        for n, part in enumerate(parts):
            params: dict[str, Any] = {**self._to(chat), "text": part}
            if markup is not None and n == len(parts) - 1:
                params["reply_markup"] = markup
            try:
                try:
                    await self.api.call("sendMessage", params)
                except BotApiError as exc:  # (a group that became a supergroup: sent there instead)
                    if exc.migrate_to is None or exc.migrate_to == params["chat_id"]:
                        raise
                    await self._migrate(params["chat_id"], exc.migrate_to)
                    params["chat_id"] = exc.migrate_to
                    await self.api.call("sendMessage", params)
            except BotApiError as exc:
                log.error("%s (chat %d): the message is dropped", exc, params["chat_id"])
                return Undelivered(str(exc), n, len(parts))
        return None

    async def _typing(self, chat: Chat) -> None:
        await self._try("sendChatAction", {**self._to(chat), "action": "typing"}, attempts=1)

    async def _answer(self, query_id: str, text: str) -> None:
        await self._try("answerCallbackQuery", {"callback_query_id": query_id, "text": text})

    async def _try(self, method: str, params: dict[str, Any], attempts: int = 3) -> None:
        """A call whose failure costs only looks (an edit, a "typing…"): a few tries, then logged."""
        try:
            await self.api.call(method, params, attempts=attempts)
        except BotApiError as exc:
            log.info("%s", exc)
