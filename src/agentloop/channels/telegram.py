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

Only the Telegram users on the allow-list reach a process: anyone else gets a short refusal
(with their user id, so the bot's owner can add them) and their message goes nowhere. An empty
allow-list refuses everyone.

What survives a restart:

- the chat's process: it is spawned with the process kv ``telegram.chat`` = ``<bot id>:<chat id>``
  (in the same transaction), and found again by that key;
- the ``getUpdates`` offset and, per process, the last signal acted on: a small JSON file,
  ``<data dir>/var/telegram/<bot id>.json``. The store has no table for state that belongs to no
  process, and the offset belongs to the bot. The offset advances only after an update was handled,
  so a crash in between delivers the update again, once: its input is sent with the run id
  ``telegram-<bot>-<chat>-<update id>``, which ``Process.send`` admits only once. A follower resumes
  from its last signal, so an answer that finished while the bridge was down is still sent (one
  sent just before a crash may be sent twice: at least once, never lost).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterable, Mapping
from contextlib import aclosing, suppress
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import httpx

from agentloop.channels.botapi import DEFAULT_API_URL, BotApi, BotApiError
from agentloop.channels.state import ChannelState
from agentloop.channels.telegram_text import approval_keyboard, describe_request, parse_callback, split_message
from agentloop.kernel import Kernel, NoSuchProcess, Process, Signal
from agentloop.process import signals as sig
from agentloop.process.archive import check_name

log = logging.getLogger("agentloop.channels.telegram")

CHAT_KEY = "telegram.chat"  # process kv: "<bot id>:<chat id>" of the chat the process talks with
_DECISIONS = {"a": ("approve", False), "d": ("deny", False), "r": ("approve", True)}
_OUTCOMES = {"a": "✅ Approved", "d": "❌ Denied", "r": "✅ Approved, and allowed from now on"}
NOT_PENDING = "This request is no longer pending."
CLOSE_GRACE = 5.0  # seconds ``close`` lets an update or a signal being handled finish
REFUSE_EVERY = 3600.0  # seconds: a chat that is refused is told so at most this often

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


class TelegramBridge:
    """Connects a Telegram bot to ``kernel``: see the module doc.

    ``allow`` are the Telegram user ids that may talk to the agent (and answer its approvals);
    ``api_url`` the Bot API server; ``account`` the account every chat's process belongs to
    (default: ``telegram-<user id>`` of the person who wrote first in the chat); ``context`` is
    given to each process at spawn; ``poll_timeout`` the seconds one ``getUpdates`` waits for news;
    ``state_dir`` where the state file is kept (default ``<data dir>/var/telegram``); ``backoff``
    the (first, longest) wait between retries; ``transport`` replaces the network (tests)."""

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
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        allowed = list(allow)
        if any(_int(uid) is None for uid in allowed):
            raise TypeError("allow must be Telegram user ids (integers)")
        if account is not None:
            check_name(account, "account")
        if _int(poll_timeout) is None or not 0 <= poll_timeout <= 600:
            raise ValueError(f"poll_timeout must be whole seconds from 0 to 600, got {poll_timeout!r}")
        self.kernel = kernel
        self.allow = frozenset(allowed)
        self.account = account
        self.context = context
        self.poll_timeout = poll_timeout
        self.api = BotApi(token, api_url, backoff=backoff, timeout=30.0, transport=transport)
        self.state_dir = Path(state_dir) if state_dir is not None else kernel.data_dir / "var" / "telegram"
        self.bot_id = 0
        self.username = ""
        self.state = ChannelState(self.state_dir / "unknown.json")
        self._chats: dict[int, str] = {}  # chat id -> pid
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._poller: asyncio.Task[None] | None = None
        # held while an update ("poll") or a process's signal (its pid) is handled: ``close`` waits
        # for them, so that what was sent is also recorded as sent
        self._busy: dict[str, asyncio.Lock] = {}
        # chat id -> when it was last told it is refused: a stranger who writes a thousand times
        # gets one answer, and cannot keep the bot busy (and rate-limited) answering them
        self._refused: dict[int, float] = {}

    async def __aenter__(self) -> TelegramBridge:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

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
        update or a signal being handled is given ``CLOSE_GRACE`` seconds to finish first."""
        tasks = {key: t for key, t in {"poll": self._poller, **self._followers}.items() if t is not None}
        # (the locks are fair: once asked for, the poller takes no further update)
        acquiring = [asyncio.ensure_future(self._lock(key).acquire()) for key, t in tasks.items() if not t.done()]
        if acquiring:
            await asyncio.wait(acquiring, timeout=CLOSE_GRACE)
        for task in (*acquiring, *tasks.values()):
            task.cancel()
        await asyncio.gather(*acquiring, *tasks.values(), return_exceptions=True)
        self._followers.clear()
        self._busy.clear()
        self._poller = None
        await self.api.close()

    def _lock(self, key: str) -> asyncio.Lock:
        return self._busy.setdefault(key, asyncio.Lock())

    async def _find_chats(self) -> None:
        """The chats' processes, by their ``telegram.chat`` kv: this bot's, of the owner the bridge
        would give them now (the newest when a chat has several), and not killed."""
        found: dict[int, tuple[float, str]] = {}
        prefix = f"{self.bot_id}:"
        for pid, value in (await self.kernel.store.kv_values(CHAT_KEY, self.account)).items():
            if not isinstance(value, str) or not value.startswith(prefix):
                continue
            try:
                chat_id = int(value[len(prefix) :])
            except ValueError:
                continue
            record = await self.kernel.store.get_process(pid)
            if record is None or record.state == "killed":
                continue
            if self.account is None and not record.owner.startswith("telegram-"):
                continue
            if chat_id not in found or record.created_at > found[chat_id][0]:
                found[chat_id] = (record.created_at, pid)
        for chat_id, (_, pid) in found.items():
            self._chats[chat_id] = pid
            self._follow(chat_id, pid)

    # -- from Telegram ---------------------------------------------------------------------------

    async def _poll(self) -> None:
        delay = self.api.backoff[0]
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
            before = self.state.offset
            if isinstance(updates, list):
                for update in updates:
                    async with self._lock("poll"):
                        await self._take(update)
            else:
                log.warning("Telegram getUpdates answered something other than a list of updates")
            if updates != [] and self.state.offset == before:  # nothing taken: do not ask again at once
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 0.05), self.api.backoff[1])
            else:
                delay = self.api.backoff[0]

    async def _take(self, update: object) -> None:
        """Handle one update, then move the offset past it (also when handling failed: an update
        that breaks the bridge must not come back for ever)."""
        update_id = _int(_field(update, "update_id"))
        if update_id is None:
            log.warning("skipped a Telegram update without an update_id")
            return
        if update_id < self.state.offset:
            return
        try:
            await self._handle(cast("dict[str, Any]", update), update_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reason = self.api.redact(f"{type(exc).__name__}: {exc}")
            log.error("Telegram update %d was not handled: %s", update_id, reason)
        self.state.offset = update_id + 1
        await self.state.save()

    async def _handle(self, update: dict[str, Any], update_id: int) -> None:
        if isinstance(update.get("message"), dict):
            await self._on_message(update["message"], update_id)
        elif isinstance(update.get("callback_query"), dict):
            await self._on_callback(update["callback_query"])

    async def _on_message(self, message: dict[str, Any], update_id: int) -> None:
        chat_id = _int(_field(message.get("chat"), "id"))
        user_id = _int(_field(message.get("from"), "id"))
        if chat_id is None:
            return
        if user_id is None or user_id not in self.allow:
            await self._refuse(chat_id, user_id)
            return
        text = message.get("text")
        if not isinstance(text, str) or not text.strip():
            await self._send(chat_id, "I can read text messages only.")
            return
        command = self._command(text)
        if command in ("start", "help"):
            await self._send(chat_id, HELP)
        elif command == "new":
            await self._reset(chat_id)
        elif command == "stop":
            await self._stop(chat_id)
        else:
            await self._deliver(chat_id, user_id, text, update_id)

    async def _refuse(self, chat_id: int, user_id: int | None) -> None:
        now = asyncio.get_running_loop().time()
        last = self._refused.get(chat_id)
        if last is not None and now - last < REFUSE_EVERY:
            log.debug("refused another message from Telegram user %s in chat %d", user_id, chat_id)
            return
        log.warning("refused a message from Telegram user %s in chat %d: not on the allow-list", user_id, chat_id)
        self._refused[chat_id] = now
        if user_id is not None:
            await self._send(chat_id, f"Sorry, this bot is private. (Your Telegram user id is {user_id}.)")

    def _command(self, text: str) -> str | None:
        """``new`` for "/new" or "/new@thisbot"; None for text and for another bot's command."""
        if not text.startswith("/"):
            return None
        name, _, bot = text.split(maxsplit=1)[0][1:].partition("@")
        if bot and bot.lower() != self.username.lower():
            return None
        return name.lower() if name.lower() in ("start", "help", "new", "stop") else None

    async def _deliver(self, chat_id: int, user_id: int, text: str, update_id: int) -> None:
        run_id = f"telegram-{self.bot_id}-{chat_id}-{update_id}"  # a redelivered update is admitted once
        for _ in range(2):  # (again with a new process, when the chat's was killed meanwhile)
            proc = await self._process(chat_id, user_id)
            try:
                await proc.send(text, mode="queue", run_id=run_id)
                return
            except NoSuchProcess:
                self._forget(chat_id)
            except (ValueError, TypeError) as exc:  # text a process cannot keep (a lone surrogate)
                await self._send(chat_id, f"That message was refused: {exc}")
                return

    async def _process(self, chat_id: int, user_id: int) -> Process:
        pid = self._chats.get(chat_id)
        if pid is not None:
            try:
                return await self.kernel.process(pid)
            except NoSuchProcess:
                self._forget(chat_id)
        owner = self.account or f"telegram-{user_id}"
        proc = await self.kernel.spawn(
            owner, interactive=True, context=self.context, kv={CHAT_KEY: f"{self.bot_id}:{chat_id}"}
        )
        log.info("chat %d talks with process %s (owner %s)", chat_id, proc.pid, owner)
        self._chats[chat_id] = proc.pid
        self.state.seqs[proc.pid] = 0  # its every signal is news, after a crash too:
        await self.state.save()  # (unknown, its follower would begin at the end of its log)
        self._follow(chat_id, proc.pid)
        return proc

    def _forget(self, chat_id: int) -> None:
        pid = self._chats.pop(chat_id, None)
        if pid is not None:
            self.state.seqs.pop(pid, None)
            follower = self._followers.pop(pid, None)
            if follower is not None and follower is not asyncio.current_task():
                follower.cancel()
            self._busy.pop(pid, None)

    async def _reset(self, chat_id: int) -> None:
        pid = self._chats.get(chat_id)
        if pid is not None:
            try:
                await (await self.kernel.process(pid)).reset()
            except NoSuchProcess:
                self._forget(chat_id)
        await self._send(chat_id, "Started a new conversation.")

    async def _stop(self, chat_id: int) -> None:
        pid = self._chats.get(chat_id)
        stopped = False
        if pid is not None:
            with suppress(NoSuchProcess):
                stopped = await (await self.kernel.process(pid)).abort()
        if not stopped:  # (else the run's end says "Stopped.")
            await self._send(chat_id, "Nothing is running.")

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
        chat_id = _int(_field(_field(message, "chat"), "id"))
        pid = self._chats.get(chat_id) if chat_id is not None else None
        decided = False
        if pid is not None:
            decision, remember = _DECISIONS[key]
            try:
                decided = await (await self.kernel.process(pid)).hil(request_id, decision, remember=remember)
            except (KeyError, NoSuchProcess):  # answered already, or its run ended
                decided = False
        outcome = _OUTCOMES[key] if decided else NOT_PENDING
        await self._answer(query_id, outcome)
        if chat_id is not None:
            await self._settle(chat_id, message, outcome, _field(query.get("from"), "first_name"))
        if decided and key != "d" and chat_id is not None:
            await self._typing(chat_id)  # the run goes on

    async def _settle(self, chat_id: int, message: Any, outcome: str, who: object) -> None:
        """The approval message, its buttons taken away and what became of it added."""
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

    def _follow(self, chat_id: int, pid: str) -> None:
        if pid not in self._followers:
            task = asyncio.create_task(self._follower(chat_id, pid), name=f"agentloop-telegram-{pid}")
            self._followers[pid] = task

    async def _follower(self, chat_id: int, pid: str) -> None:
        """Act on the process's signals from the last one acted on, for as long as it lives."""
        delay = self.api.backoff[0]
        while True:
            try:
                proc = await self.kernel.process(pid)
                after = self.state.seqs.get(pid)
                if after is None:  # (the state file was lost: what is logged was dealt with)
                    after = await self.kernel.store.last_event_seq(pid)
                stream = cast("AsyncGenerator[Signal, None]", proc.signals(after_seq=after, follow=True))
                async with aclosing(stream) as signals:
                    async for signal in signals:
                        async with self._lock(pid):
                            await self._on_signal(chat_id, proc, signal)
                        delay = self.api.backoff[0]
                return  # the process is gone
            except NoSuchProcess:
                if self._chats.get(chat_id) == pid:
                    self._forget(chat_id)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = self.api.redact(f"{type(exc).__name__}: {exc}")
                log.error("following process %s failed (%s); again in %.0f s", pid, reason, delay)
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 0.05), self.api.backoff[1])

    async def _on_signal(self, chat_id: int, proc: Process, signal: Signal) -> None:
        payload = signal.payload
        if signal.signal == sig.RUN_STARTED:
            await self._typing(chat_id)
        elif signal.signal == sig.HIL_REQUESTED:
            await self._ask(chat_id, proc, payload)
        elif signal.signal == sig.RUN_FINISHED:
            await self._finished(chat_id, payload)
        else:
            return
        if signal.seq is not None and signal.signal != sig.RUN_STARTED:
            self.state.seqs[proc.pid] = signal.seq
            await self.state.save()

    async def _ask(self, chat_id: int, proc: Process, payload: Mapping[str, Any]) -> None:
        request_id = payload.get("requestId")
        keyboard = approval_keyboard(request_id) if isinstance(request_id, str) else None
        if keyboard is None:
            return
        if not any(row.request_id == request_id for row in await proc.pending_approvals()):
            return  # answered before this was read (a follower catching up after a restart)
        await self._send(chat_id, describe_request(payload), keyboard)

    async def _finished(self, chat_id: int, payload: Mapping[str, Any]) -> None:
        if payload.get("quiet"):  # a heartbeat's "nothing to do"
            return
        text = payload.get("text")
        status = payload.get("status")
        if isinstance(text, str) and text.strip():
            await self._send(chat_id, text)
        elif status == "error":
            error = str(payload.get("error") or payload.get("reason") or "the model call failed")
            await self._send(chat_id, f"⚠️ The answer failed: {error[:1000]}")
        elif status == "aborted":
            if payload.get("reason") != "process.reset":
                await self._send(chat_id, "Stopped.")
        else:
            await self._send(chat_id, "(The agent finished without an answer.)")

    async def _send(self, chat_id: int, text: str, markup: dict[str, Any] | None = None) -> None:
        """``text`` to the chat, in as many messages as it takes (the buttons on the last).
        Transient failures are retried until they pass; a permanent one (the user blocked the
        bot, the chat is gone) is logged, and the text dropped."""
        parts = split_message(text)
        for n, part in enumerate(parts):
            params: dict[str, Any] = {"chat_id": chat_id, "text": part}
            if markup is not None and n == len(parts) - 1:
                params["reply_markup"] = markup
            try:
                await self.api.call("sendMessage", params)
            except BotApiError as exc:
                log.error("%s (chat %d): the message is dropped", exc, chat_id)
                return

    async def _typing(self, chat_id: int) -> None:
        await self._try("sendChatAction", {"chat_id": chat_id, "action": "typing"}, attempts=1)

    async def _answer(self, query_id: str, text: str) -> None:
        await self._try("answerCallbackQuery", {"callback_query_id": query_id, "text": text})

    async def _try(self, method: str, params: dict[str, Any], attempts: int = 3) -> None:
        """A call whose failure costs only looks (an edit, a "typing…"): a few tries, then logged."""
        try:
            await self.api.call(method, params, attempts=attempts)
        except BotApiError as exc:
            log.info("%s", exc)
