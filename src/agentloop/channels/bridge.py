"""What every chat channel does the same way: one durable process per chat, and a follower per
process that turns its signals into the app's messages.

``ChatBridge`` keeps the chat → process map (found again at start by a process kv the process is
spawned with), admits a chat's input with a caller-supplied run id (so an app that delivers a
message twice runs it once), and follows each process from the last signal acted on (kept in the
channel's ``ChannelState`` file): ``proc.run.started`` becomes "typing…", ``proc.run.hil.requested``
an approval request with buttons, ``proc.run.finished`` the answer. A signal is recorded as acted
on only after its message went out, so an answer is sent at least once and never lost.

A channel subclasses it and says how to reach its app: ``_send`` (text, in as many messages as the
app needs), ``_typing``, ``_send_approval``, how its kv value names a chat (``_kv_value`` and
``_chat_of``), and how a file a user sent is downloaded (``_fetch``: what becomes of images,
documents, videos (a note, never downloaded) and, with a ``transcriber``, voice messages is shared,
``_deliver_files``, see ``agentloop.channels.media``). Each message goes with its ``Origin`` (who
wrote it, in a direct chat or a group's): in a group, where one process hears several people, the
model is told who speaks (``messages.with_speakers``).

An answer the app refuses for good (the user blocked the bot, the chat is gone: ``_send`` answers
``Undelivered`` once its retries are over) is logged by the channel, as before, and also noted in
the process's history (``Kernel.note``: a system message that starts no run), once per run: the
model reads on its next turn that the user never saw it, and so does whoever reads the history.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable, Mapping, Sequence
from contextlib import aclosing, suppress
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, Generic, Self, TypeVar

from agentloop.channels.media import (
    FETCH_TRIES,
    MAX_FILE_BYTES,
    TRANSCRIBE_SECONDS,
    Attachment,
    FetchFailed,
    Kind,
    TooLarge,
    Transcriber,
    audio_filename,
    audio_type,
    block_of,
    cap_of,
    classify,
    clean_transcript,
    default_text,
    no_words,
    not_transcribed,
    refusal,
    too_large,
    transcript_text,
    video_kind,
    video_text,
)
from agentloop.channels.state import ChannelState
from agentloop.kernel import Kernel, NoSuchProcess, Process, ProcessBusy, RunActive, Signal
from agentloop.messages import FileContent, ImageContent, Origin
from agentloop.process import admission
from agentloop.process import signals as sig
from agentloop.process.audio_video import check_transcriber, transcribe_audio
from agentloop.process.media import MediaError
from agentloop.urls import redact_secrets

K = TypeVar("K", bound=Hashable)

# a button's key -> (decision, remember): approve, deny, approve and remember
DECISIONS = {"a": ("approve", False), "d": ("deny", False), "r": ("approve", True)}
OUTCOMES = {"a": "✅ Approved", "d": "❌ Denied", "r": "✅ Approved, and allowed from now on"}
NOT_PENDING = "This request is no longer pending."
# a process's row, per run id of a message typed while approvals waited: the requests it declines
DECLINES = "bridge.declines:"
CLOSE_GRACE = 5.0  # seconds ``close`` lets an update or a signal being handled finish
REFUSE_EVERY = 3600.0  # seconds: a chat that is refused is told so at most this often
NOTE_TRIES = 5  # times the note of an undelivered answer is tried (a store error, a busy process)
SHOWN_ANSWER = 80  # characters of an undelivered answer its note quotes


@dataclass(frozen=True)
class Undelivered:
    """What ``_send`` answers when its text did not (all) reach the chat: the app refused it for
    good, or its retries ran out. ``reason`` is the app's error as the channel logs it (never
    with a secret); ``sent`` of the ``parts`` messages the text took went out before it."""

    reason: str
    sent: int = 0
    parts: int = 1


class RefusalThrottle(Generic[K]):
    """When a refused chat is told so again: at most every ``REFUSE_EVERY`` seconds, so a stranger
    who writes a thousand times gets one answer and cannot keep the bot busy (and rate-limited).
    Chats refused longer ago are forgotten, so strangers cost no memory over time."""

    def __init__(self) -> None:
        self._told: dict[K, float] = {}

    def due(self, chat: K) -> bool:
        """Whether ``chat`` is to be told now (it is then not told again for a while)."""
        now = asyncio.get_running_loop().time()
        last = self._told.get(chat)
        if last is not None and now - last < REFUSE_EVERY:
            return False
        if len(self._told) >= 1024:  # (pruned in batches: a dict walk per refusal would be the cost)
            self._told = {c: t for c, t in self._told.items() if now - t < REFUSE_EVERY}
        self._told[chat] = now
        return True


class ChatBridge(Generic[K]):
    """The chat ↔ process half of a channel (see the module doc). ``CHAT_KEY`` is the process kv
    naming its chat, ``OWNER_PREFIX`` what a chat's account is called without ``account``
    (``<prefix><user>``), ``NAME`` the channel in logs and task names."""

    CHAT_KEY: ClassVar[str]
    OWNER_PREFIX: ClassVar[str]
    NAME: ClassVar[str]
    APP: ClassVar[str]  # the app as its users name it ("WhatsApp"), in the notes the process is given
    COMMAND_PREFIX: ClassVar[str] = "/"  # what the channel's commands start with ("/new")
    log: ClassVar[logging.Logger]

    def __init__(
        self,
        kernel: Kernel,
        *,
        account: str | None,
        context: str,
        state: ChannelState,
        backoff: tuple[float, float],
        max_file_bytes: int = MAX_FILE_BYTES,
        transcriber: Transcriber | None = None,
    ) -> None:
        if isinstance(max_file_bytes, bool) or not isinstance(max_file_bytes, int) or max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be a positive number of bytes, got {max_file_bytes!r}")
        if transcriber is not None:
            check_transcriber(transcriber)
        self.kernel = kernel
        self.max_file_bytes = max_file_bytes
        self.transcriber = transcriber  # voice messages and audio files are refused without one
        self.account = account
        self.context = context
        self.state = state
        self._backoff = backoff
        self._chats: dict[K, str] = {}  # chat -> pid
        self._followers: dict[str, asyncio.Task[None]] = {}
        # held while input (its key) or a process's signal (its pid) is handled: ``close`` waits
        # for them, so that what was sent is also recorded as sent
        self._busy: dict[str, asyncio.Lock] = {}
        self._noting: set[asyncio.Task[None]] = set()  # notes of undelivered answers, on their way

    # -- what a channel says ---------------------------------------------------------------------

    def _kv_value(self, chat: K) -> str:
        raise NotImplementedError

    def _chat_of(self, value: str) -> K | None:
        """The chat a kv value names, None for one that is not this bridge's."""
        raise NotImplementedError

    def redact(self, text: str) -> str:
        """``text`` without the channel's secrets."""
        return text

    async def _send(self, chat: K, text: str) -> Undelivered | None:
        """``text`` to the chat, in as many messages as the app needs, transient failures retried;
        None once it went out, else why it (or its rest) did not (logged by the channel)."""
        raise NotImplementedError

    def _where(self, chat: K) -> str:
        """The chat as a note to its process names it."""
        return f"the {self.APP} chat {chat}"

    async def _say(self, chat: K, text: str) -> None:
        """A short notice in answer to the user's input (``_send`` unless the channel defers it)."""
        await self._send(chat, text)

    async def _typing(self, chat: K) -> None:
        """Show that the agent is at work (nothing, where the app cannot)."""

    async def _send_approval(self, chat: K, payload: Mapping[str, Any], request_id: str) -> None:
        raise NotImplementedError

    async def _fetch(self, attachment: Attachment, cap: int) -> bytes:
        """The bytes of ``attachment``, at most ``cap`` of them (``media.read_capped``): raises
        ``FetchFailed`` (``transient`` when asking again may help) or ``TooLarge``."""
        raise FetchFailed("this channel cannot download files", transient=False)

    def _classify(self, mime: object, name: object = "") -> tuple[Kind | None, str]:
        """``media.classify``, audio as ``"audio"`` when the bridge has a transcriber (else it is a
        type the kernel does not take, as before), and a video as ``"video"`` (a note in its place:
        every bridge can give that, so it needs nothing of the bridge)."""
        kind, declared = classify(mime, name)
        if kind is None and self.transcriber is not None:
            audio = audio_type(mime, name)
            if audio is not None:
                return "audio", audio
        if kind is None:
            video = video_kind(mime, name)
            if video is not None:
                return "video", video
        return kind, declared

    # -- life ------------------------------------------------------------------------------------

    async def start(self) -> Any:
        """Reach the app and find the chats' processes again (each channel says how)."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _lock(self, key: str) -> asyncio.Lock:
        return self._busy.setdefault(key, asyncio.Lock())

    async def _stop_tasks(self, tasks: Mapping[str, asyncio.Task[Any] | None]) -> None:
        """Cancel ``tasks`` (keyed by their lock) and the followers, each given ``CLOSE_GRACE``
        seconds to finish what it is handling."""
        every = {key: t for key, t in {**tasks, **self._followers}.items() if t is not None}
        # (the locks are fair: once asked for, no further input or signal is taken)
        acquiring = [asyncio.ensure_future(self._lock(key).acquire()) for key, t in every.items() if not t.done()]
        if acquiring:
            await asyncio.wait(acquiring, timeout=CLOSE_GRACE)
        noting = [*self._noting]  # (one waiting for a long run to end is given up: it is logged)
        if noting:
            await asyncio.wait(noting, timeout=CLOSE_GRACE)
        for task in (*acquiring, *every.values(), *noting):
            task.cancel()
        await asyncio.gather(*acquiring, *every.values(), *noting, return_exceptions=True)
        self._followers.clear()
        self._busy.clear()

    async def _find_chats(self) -> None:
        """The chats' processes, by their kv: this bridge's, of the owner the bridge would give
        them now (the newest when a chat has several), and not killed. Each is followed."""
        found: dict[K, tuple[float, str]] = {}
        for pid, value in (await self.kernel.store.kv_values(self.CHAT_KEY, self.account)).items():
            chat = self._chat_of(value) if isinstance(value, str) else None
            if chat is None:
                continue
            record = await self.kernel.store.get_process(pid)
            if record is None or record.state == "killed":
                continue
            if self.account is None and not record.owner.startswith(self.OWNER_PREFIX):
                continue
            if chat not in found or record.created_at > found[chat][0]:
                found[chat] = (record.created_at, pid)
        for chat, (_, pid) in found.items():
            self._chats[chat] = pid
            self._follow(chat, pid)

    # -- from the chat ---------------------------------------------------------------------------

    async def _deliver(
        self,
        chat: K,
        user: object,
        text: str,
        run_id: str,
        media: Sequence[ImageContent | FileContent] = (),
        *,
        origin: Origin | None = None,
    ) -> None:
        """``text`` (and ``media``) to the chat's process (spawned when it has none), admitted once
        per ``run_id``, with its ``origin`` (who wrote it: in a group chat the model is told, since
        a process there hears several people). Each message is a run of its own (``queue``),
        except one written while the process waits for an approval: a chat has no prompt to type
        an answer into, so a user who writes instead of pressing a button ("no, keep it") declines
        what waits, and the message joins the run that asked (``steer``), which reads the refusal
        and the words together."""
        for _ in range(2):  # (again with a new process, when the chat's was killed meanwhile)
            proc = await self._process(chat, user)
            try:
                if await self._admitted(chat, run_id):  # taken again: what its first take declines
                    await self._decline(proc, run_id)
                    return
                declines = [request.request_id for request in await proc.pending_approvals()]
                await self._keep_declines(proc.pid, run_id, declines)
                try:
                    await proc.send(
                        text, mode="steer" if declines else "queue", media=media, run_id=run_id, origin=origin
                    )
                except (ValueError, TypeError):  # (refused: it declines nothing)
                    await self._keep_declines(proc.pid, run_id, [])
                    raise
                await self._decline(proc, run_id)  # (after the send: the run must find the words when it goes on)
                return
            except NoSuchProcess:
                self._forget(chat)
            except (ValueError, TypeError) as exc:  # text a process cannot keep (a lone surrogate)
                await self._say(chat, f"That message was refused: {exc}")
                return

    async def _keep_declines(self, pid: str, run_id: str, declines: list[str]) -> None:
        """Keep (or, with none, drop) the requests the input ``run_id`` declines, before its send:
        a take that fails after the send still declines them when it is taken again."""
        store = self.kernel.store
        if declines or await store.kv_get(pid, DECLINES + run_id) is not None:
            async with store.transaction():
                if declines:
                    await store.kv_set(pid, DECLINES + run_id, declines)
                else:  # (kept by an earlier take whose send failed; answered since)
                    await store.kv_delete(pid, DECLINES + run_id)

    async def _decline(self, proc: Process, run_id: str) -> None:
        """Deny the requests the admitted input ``run_id`` declines (kept by ``_keep_declines``)."""
        declines = await self.kernel.store.kv_get(proc.pid, DECLINES + run_id)
        if not declines:
            return
        for request_id in declines:
            with suppress(KeyError):  # answered meanwhile
                await proc.hil(request_id, "deny")
        async with self.kernel.store.transaction():
            await self.kernel.store.kv_delete(proc.pid, DECLINES + run_id)

    async def _deliver_files(
        self,
        chat: K,
        user: object,
        text: str,
        run_id: str,
        attachments: Sequence[Attachment],
        *,
        origin: Origin | None = None,
    ) -> None:
        """A message with files: each fetched (and checked) before anything is admitted, then
        ``text`` (a short default when empty) with them as one input, admitted once per ``run_id``.
        A file that is of a type the kernel does not take, too large, not what it says or cannot
        be fetched: the user is told, and nothing of the message reaches the process. An audio
        file (``"audio"``, with a transcriber) is given as its transcript, after ``text``; one
        whose transcription fails is told to the user and left out, and the rest goes on. A video
        (``"video"``) is given as a note of it (``media.video_text``), after ``text`` in the order
        attached, and is not downloaded: the note needs only what the message said of it, and no
        model could use the bytes."""
        problem = refusal(attachments, self.max_file_bytes)
        if problem is not None:
            self.log.info("refused a message with files in chat %s: %s", chat, problem)
            await self._say(chat, problem)
            return
        if await self._admitted(chat, run_id):  # (taken before a crash, or delivered again: not downloaded again)
            pid = self._chats.get(chat)
            if pid is not None:  # what it declines, when the first take failed after the send
                with suppress(NoSuchProcess):
                    await self._decline(await self.kernel.process(pid), run_id)
            return
        blocks: list[ImageContent | FileContent] = []
        spoken: list[str] = []  # the transcripts and the videos' notes, marked, in the order attached
        for attachment in attachments:
            what = attachment.what[:1].upper() + attachment.what[1:]
            if attachment.kind == "video":
                self.log.info("noted %s in chat %s (%s; not downloaded)", attachment.what, chat, attachment.mime)
                spoken.append(video_text(attachment))
                continue
            try:
                data = await self._fetch_retried(attachment, cap_of(attachment, self.max_file_bytes))
                if attachment.kind == "audio":
                    transcript = await self._transcribe(chat, attachment, data)
                    if transcript is not None:
                        spoken.append(transcript_text(attachment, transcript))
                    continue
                blocks.append(block_of(attachment, data, self.max_file_bytes))
            except TooLarge:
                self.log.info("refused %s in chat %s: over the limit", attachment.what, chat)
                await self._say(chat, too_large(attachment, self.max_file_bytes))
                return
            except FetchFailed as exc:
                self.log.error("could not fetch %s in chat %s: %s", attachment.what, chat, self.redact(str(exc)))
                await self._say(chat, f"I could not fetch {attachment.what}; please send it again.")
                return
            except MediaError as exc:
                self.log.info("refused %s in chat %s: %s", attachment.what, chat, exc)
                await self._say(chat, f"{what} was refused: {exc}")
                return
        if not spoken and not blocks:  # (audio only, none transcribed: the user was told; a caption alone is not sent)
            return
        others = [a for a in attachments if a.kind not in ("audio", "video")]
        parts = [text] if text.strip() else ([] if spoken else [default_text(others)])
        await self._deliver(chat, user, "\n\n".join([*parts, *spoken]), run_id, blocks, origin=origin)

    async def _transcribe(self, chat: K, attachment: Attachment, data: bytes) -> str | None:
        """The words of the audio ``attachment`` (its bytes ``data``), cleaned; None when the
        transcription failed or found no words, which the user is told (and the log, never with
        a secret)."""
        transcriber = self.transcriber
        if transcriber is None:  # (not made "audio" without one)
            return None
        try:
            async with asyncio.timeout(TRANSCRIBE_SECONDS):
                said = await transcribe_audio(transcriber, data, audio_filename(attachment), attachment.mime)
            if not isinstance(said, str):
                raise TypeError(f"the transcriber answered {type(said).__name__}, not text")
        except Exception as exc:  # (anything: a transcriber's failure must not fail the take)
            timed_out = isinstance(exc, TimeoutError) and not str(exc)
            said_why = redact_secrets(self.redact(f"{type(exc).__name__}: {exc}"))  # (the channel's token, any key)
            reason = f"no answer in {TRANSCRIBE_SECONDS:.0f} s" if timed_out else said_why[:500]
            self.log.error("could not transcribe %s in chat %s: %s", attachment.what, chat, reason)
            await self._say(chat, not_transcribed(attachment.what))
            return None
        transcript = clean_transcript(said)
        if not transcript:
            self.log.info("the transcript of %s in chat %s holds no words", attachment.what, chat)
            await self._say(chat, no_words(attachment.what))
            return None
        self.log.info("transcribed %s in chat %s (%d characters)", attachment.what, chat, len(transcript))
        return transcript

    async def _fetch_retried(self, attachment: Attachment, cap: int) -> bytes:
        """``_fetch``, tried again with the channel's backoff while it fails for a reason that may
        pass, ``FETCH_TRIES`` times in all."""
        first, longest = self._backoff
        delay = first
        tried = 0
        while True:
            tried += 1
            try:
                return await self._fetch(attachment, cap)
            except FetchFailed as exc:
                if not exc.transient or tried >= FETCH_TRIES:
                    raise
                reason = self.redact(str(exc))
                self.log.warning("fetching %s failed (%s); trying again in %.1f s", attachment.what, reason, delay)
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 0.05), longest)

    async def _admitted(self, chat: K, run_id: str) -> bool:
        """Whether the chat's process admitted input with ``run_id`` already."""
        pid = self._chats.get(chat)
        if pid is None:
            return False
        return await admission.admitted(self.kernel.engine, pid, run_id) is not None

    async def _process(self, chat: K, user: object) -> Process:
        pid = self._chats.get(chat)
        if pid is not None:
            try:
                return await self.kernel.process(pid)
            except NoSuchProcess:
                self._forget(chat)
        owner = self.account or f"{self.OWNER_PREFIX}{user}"
        proc = await self.kernel.spawn(
            owner, interactive=True, context=self.context, kv={self.CHAT_KEY: self._kv_value(chat)}
        )
        self.log.info("chat %s talks with process %s (owner %s)", chat, proc.pid, owner)
        self._chats[chat] = proc.pid
        self.state.seqs[proc.pid] = 0  # its every signal is news, after a crash too:
        await self.state.save()  # (unknown, its follower would begin at the end of its log)
        self._follow(chat, proc.pid)
        return proc

    def _forget(self, chat: K) -> None:
        pid = self._chats.pop(chat, None)
        if pid is not None:
            self.state.seqs.pop(pid, None)
            follower = self._followers.pop(pid, None)
            if follower is not None and follower is not asyncio.current_task():
                follower.cancel()
            self._busy.pop(pid, None)

    async def _reset(self, chat: K) -> None:
        pid = self._chats.get(chat)
        if pid is not None:
            try:
                await (await self.kernel.process(pid)).reset()
            except NoSuchProcess:
                self._forget(chat)
            except ProcessBusy:  # another worker holds it (a shared store) and will not let go now
                await self._say(
                    chat, f"The conversation is busy elsewhere; try {self.COMMAND_PREFIX}new again in a moment."
                )
                return
        await self._say(chat, "Started a new conversation.")

    async def _stop(self, chat: K) -> None:
        pid = self._chats.get(chat)
        stopped = False
        if pid is not None:
            with suppress(NoSuchProcess):
                stopped = await (await self.kernel.process(pid)).abort()
        if not stopped:  # (else the run's end says "Stopped.")
            await self._say(chat, "Nothing is running.")

    async def _decide(self, chat: K | None, key: str, request_id: str) -> str:
        """Answer the chat's approval ``request_id`` as the button ``key`` says; what became of it."""
        pid = self._chats.get(chat) if chat is not None else None
        decided = False
        if pid is not None:
            decision, remember = DECISIONS[key]
            try:
                decided = await (await self.kernel.process(pid)).hil(request_id, decision, remember=remember)
            except (KeyError, NoSuchProcess):  # answered already, or its run ended
                decided = False
        return OUTCOMES[key] if decided else NOT_PENDING

    # -- to the chat -----------------------------------------------------------------------------

    def _follow(self, chat: K, pid: str) -> None:
        if pid not in self._followers:
            task = asyncio.create_task(self._follower(chat, pid), name=f"agentloop-{self.NAME}-{pid}")
            self._followers[pid] = task

    async def _follower(self, chat: K, pid: str) -> None:
        """Act on the process's signals from the last one acted on, for as long as it lives."""
        first, longest = self._backoff
        delay = first
        while True:
            try:
                proc = await self.kernel.process(pid)
                after = self.state.seqs.get(pid)
                if after is None:  # (the state file was lost: what is logged was dealt with)
                    after = await self.kernel.store.last_event_seq(pid)
                stream = proc.signals(after_seq=after, follow=True)
                async with aclosing(stream) as signals:
                    async for signal in signals:
                        async with self._lock(pid):
                            await self._on_signal(chat, proc, signal)
                        delay = first
                return  # the process is gone
            except NoSuchProcess:
                if self._chats.get(chat) == pid:
                    self._forget(chat)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = self.redact(f"{type(exc).__name__}: {exc}")
                self.log.error("following process %s failed (%s); again in %.0f s", pid, reason, delay)
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 0.05), longest)

    async def _on_signal(self, chat: K, proc: Process, signal: Signal) -> None:
        payload = signal.payload
        if signal.signal == sig.RUN_STARTED:
            await self._typing(chat)
        elif signal.signal == sig.HIL_REQUESTED:
            await self._ask(chat, proc, payload)
        elif signal.signal == sig.RUN_FINISHED:
            await self._finished(chat, proc, payload)
        else:
            return
        if signal.seq is not None and signal.signal != sig.RUN_STARTED:
            self.state.seqs[proc.pid] = signal.seq
            await self.state.save()

    async def _ask(self, chat: K, proc: Process, payload: Mapping[str, Any]) -> None:
        request_id = payload.get("requestId")
        if not isinstance(request_id, str):
            return
        if not await self._waits_for(proc, request_id):
            return  # answered before this was read (a follower catching up after a restart)
        await self._send_approval(chat, payload, request_id)

    @staticmethod
    async def _waits_for(proc: Process, request_id: str) -> bool:
        """Whether ``proc`` still waits for an answer to approval request ``request_id``."""
        return any(row.request_id == request_id for row in await proc.pending_approvals())

    async def _finished(self, chat: K, proc: Process, payload: Mapping[str, Any]) -> None:
        """Send what the run's end says to the chat; if the app refused it for good, note that in
        the process (``_note_undelivered``)."""
        if payload.get("quiet"):  # a heartbeat's "nothing to do"
            return
        text = payload.get("text")
        status = payload.get("status")
        if isinstance(text, str) and text.strip():
            message = text
        elif status == "error":
            error = str(payload.get("error") or payload.get("reason") or "the model call failed")
            message = f"⚠️ The answer failed: {error[:1000]}"
        elif status == "aborted":
            if payload.get("reason") == "process.reset":
                return
            message = "Stopped."
        else:
            message = "(The agent finished without an answer.)"
        failed = await self._send(chat, message)
        run_id = payload.get("runId")
        if failed is not None and isinstance(run_id, str):
            self._note_undelivered(chat, proc.pid, run_id, message, failed)

    def _note_undelivered(self, chat: K, pid: str, run_id: str, message: str, failed: Undelivered) -> None:
        """Tell the process that the end of run ``run_id`` (``message``) never reached the chat:
        a note in its history (``Kernel.note``), which starts no run (the user cannot be answered
        there anyway), so that the model knows on its next turn what the user missed and a reader
        of the history sees why the chat went quiet. Once per run (``note_id``: a follower that
        reads the run's end again after a restart, and fails again, notes nothing more). Written
        by a task of its own: a run under way is waited out (a note amid its turns would make it
        call the model again), and the follower must not wait, or that run's approval requests
        would never reach the chat."""
        shown = " ".join(message.split())
        quoted = shown if len(shown) <= SHOWN_ANSWER else shown[: SHOWN_ANSWER - 1] + "…"
        reason = redact_secrets(self.redact(failed.reason))[:300]
        partly = f" (only {failed.sent} of its {failed.parts} messages went out)" if failed.sent else ""
        text = (
            f'Automatic reply delivery failed: the answer of run {run_id} ("{quoted}") did not reach '
            f"{self._where(chat)}{partly}: {reason}. The user has not seen it."
        )
        task = asyncio.create_task(self._note(pid, run_id, text), name=f"agentloop-{self.NAME}-note-{pid}")
        self._noting.add(task)
        task.add_done_callback(self._noting.discard)

    async def _note(self, pid: str, run_id: str, text: str) -> None:
        """``Kernel.note`` once the process is idle, tried again on a failure, ``NOTE_TRIES``
        times in all; a note given up is logged (the answer's failure was logged already)."""
        first, longest = self._backoff
        delay = first
        tried = 0
        while True:
            try:
                await self.kernel.note(pid, text, note_id=f"undelivered:{run_id}")
                return
            except NoSuchProcess:
                return  # (killed meanwhile: nobody to tell)
            except RunActive:  # (no failure: waited out, however many runs come first)
                with suppress(NoSuchProcess):
                    await (await self.kernel.process(pid)).wait_idle()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                tried += 1
                why = self.redact(f"{type(exc).__name__}: {exc}")
                if tried >= NOTE_TRIES:
                    self.log.error("the undelivered answer of run %s was not noted in process %s: %s", run_id, pid, why)
                    return
                await asyncio.sleep(delay)
                delay = min(max(delay * 2, 0.05), longest)
