// One opened process: its transcript, its approvals, its event stream.
//
// How the transcript stays exact across reloads and reconnects:
// - persisted messages (GET …/messages) are rendered once each, keyed by message id;
// - logged signals carry a seq: a signal at or below the last seq seen is dropped, and every
//   reconnect sends Last-Event-ID, so the server resumes right after it;
// - opening a process (also after a reload) reads the history, then replays the signal log once
//   (follow=false) to restore run outcomes and tool results, then follows live from its last seq;
// - text deltas are live-only (never replayed); the streamed bubble is replaced by the persisted
//   message, which the full text of proc.run.output is matched against, so it is never doubled.
// - a run's first input is committed with its proc.run.started: the history is read then, and the
//   stream's later frames wait for it, so a run's output never shows before the message it answers
//   (the POST that sent it, and its pending bubble, may be answered after the whole run).
// - a reconnect after signals the log no longer holds (pruned while the page was away) gets
//   proc.log.pruned first: the history and the process's state are read again instead.
// - a closed view (the user opened another process) may still have requests in flight: whatever
//   answers after close() is dropped, since the transcript and approvals now belong to the next one.
// - the input queue (messages waiting for the active run to end, GET …/queue) is read whole when
//   the process opens and whenever a signal says it changed: proc.changed naming "queue" (input
//   queued or withdrawn, steering taken) or "reset", and a run starting (it took the next item) or
//   ending (an abort may drop what waited).
// - a rewind (made here or by another client) cuts the history back in place: its proc.changed
//   (`rewound`) re-renders the transcript from a fresh read, as a reset does (the runs still shown
//   keep their outcomes), and the stream's next frames wait for it. A retry's (`retried`: the failed
//   end of the last run removed, the run on it follows) is re-rendered the same way.
// - the last run, when it ended without an answer (an error, an abort, the output limit), offers a
//   Retry action under its footer; a later run (a retry's too) takes it away.

import { api, ApiError, procPath, sse } from "./api.js";
import { $, el, pretty, scrollDown, sleep, status, textOf } from "./dom.js";

const GAP = " … "; // where a streaming bubble lost text while the stream reconnected
const LIVE_OUTPUT = 32768; // characters of a running call's streamed output a card keeps
const SKEW = 1.5; // seconds: a request gone this close to its deadline was denied for want of an answer
const TIMED_OUT = "approval timed out"; // the error of a call the server denied because nobody answered

/** Seconds as m:ss (h:mm:ss from an hour), for an approval's countdown. */
function clock(seconds) {
  const s = Math.max(0, Math.ceil(seconds));
  const mm = Math.floor(s / 60) % 60;
  const ss = String(s % 60).padStart(2, "0");
  const h = Math.floor(s / 3600);
  return h ? `${h}:${String(mm).padStart(2, "0")}:${ss}` : `${mm}:${ss}`;
}

/** The plain text of a user message (the words only, no placeholders for images), to edit again. */
function plainText(content) {
  if (typeof content === "string") return content;
  return (content || [])
    .filter((b) => b.type === "text")
    .map((b) => b.text)
    .join("");
}

// A retry budget's `…Left` field in proc.run.tool.retry.scheduled, and what it counts: the one with
// the fewest retries left is shown (the first of them on a tie). As the terminal's (cli/render.py).
const RETRY_BUDGETS = [
  ["classLeft", "for this class"],
  ["signatureLeft", "for this call"],
  ["toolLeft", "for this tool"],
  ["roundsLeft", "in this run"],
];

/** The line a ToolRetry signal is shown with: a failure counted (the tightest budget's retries
 * left) or a budget spent (the run stops); "" for any other. */
export function toolRetryLine(signal, p) {
  if (signal === "proc.run.tool.retry.exhausted") {
    const reason = typeof p.reason === "string" && p.reason ? p.reason : `${p.budget ?? "?"} budget (${p.limit ?? "?"})`;
    return `tool retry budget spent: ${reason}; the run stops`;
  }
  if (signal !== "proc.run.tool.retry.scheduled") return "";
  const head = `${p.name || "a tool"} failed (${p.errorClass || "error"})`;
  let best = null;
  for (const [key, what] of RETRY_BUDGETS) {
    const left = p[key];
    if (Number.isInteger(left) && left >= 0 && (best === null || left < best[0])) best = [left, what];
  }
  if (best === null) return `${head}: retrying`;
  const [left, what] = best;
  const many = left === 0 ? "no retries" : left === 1 ? "1 retry" : `${left} retries`;
  return `${head}: ${many} left ${what}`;
}

/** The name a user message's speaker is shown with, above it: only a group chat's (a chat
 * bridge's, where several people write to one process) has one; "" for any other message. */
export function speakerOf(message) {
  const origin = message && message.origin;
  if (!origin || typeof origin !== "object" || origin.chat !== "group") return "";
  const name = typeof origin.name === "string" ? origin.name.trim() : "";
  const user = typeof origin.user === "string" ? origin.user.trim() : "";
  return name || user;
}

/** A heartbeat check-in whose answer only says nothing needs attention stays out of sight: a
 * person opening the page should not read "HEARTBEAT_OK" every half hour. */
function quiet(run, hidden) {
  run.block.hidden = hidden;
  run.block.classList.toggle("quiet", hidden);
}

export class ProcessView {
  /** `onFork(at, text)`: make a fork up to message `at` and open it with `text` in the composer.
   * `onRewind(at, text)`: cut this process back to message `at` and put `text` in the composer. */
  constructor(pid, onState, onFork, onRewind) {
    this.pid = pid;
    this.onState = onState;
    this.onFork = onFork;
    this.onRewind = onRewind;
    this.runs = new Map(); // runId -> {block, footer, live: [bubbles], current}
    this.messages = new Set(); // ids of rendered messages
    this.tools = new Map(); // tool call id -> card
    this.approvals = new Map(); // request id -> card
    this.countdowns = new Map(); // request id -> the interval updating its card's time left
    this.expiries = new Map(); // request id -> expiresAt, as the logged request said (the backlog)
    this.queued = new Map(); // queue item id -> item, as last read
    this.withdrawn = new Set(); // ids of the items withdrawn, whose pending bubbles are gone
    this.queueAsked = false; // a queue read is asked for and not yet begun
    this.queueLoading = Promise.resolve();
    this.lastSeq = 0;
    this.live = false; // false while the logged backlog is replayed
    this.process = null;
    this.history = Promise.resolve();
    this.rewinding = false; // a rewind asked for here is under way
    this.retryOffer = null; // the id of the run whose Retry action is shown (the last run, failed)
    this.stop = new AbortController();
    $("transcript").replaceChildren();
    $("approvals").replaceChildren();
    $("queue-list").replaceChildren();
    $("queue").hidden = true;
  }

  close() {
    this.stop.abort();
    for (const timer of this.countdowns.values()) clearInterval(timer);
    this.countdowns.clear();
  }

  get closed() {
    return this.stop.signal.aborted;
  }

  async open() {
    await this.refreshProcess();
    await this.loadHistory();
    await this.consume(false); // the logged backlog, then live from its last seq
    this.live = true;
    await this.refreshApprovals();
    await this.refreshQueue();
    this.follow();
  }

  async follow() {
    while (!this.closed) {
      try {
        status(`following ${this.pid}`);
        await this.consume(true);
      } catch (err) {
        if (this.closed) return;
        if (err instanceof ApiError && err.status === 404) {
          this.notice(null, "this process no longer exists");
          this.onState(null);
          return;
        }
        if (err instanceof ApiError && err.status === 401) return;
        status(`stream interrupted (${err.message}); reconnecting…`);
      }
      this.streaming("reconnecting");
      if (this.closed) return;
      this.markGaps();
      await sleep(1000); // the stream ended (restart, shutdown): reconnect with Last-Event-ID
    }
  }

  async consume(follow) {
    const path = procPath(this.pid, `/events?follow=${follow}`);
    const opened = () => this.streaming(follow ? "live" : "replaying");
    for await (const frame of sse(path, this.lastSeq, this.stop.signal, opened)) {
      if (this.closed) return;
      let item;
      try {
        item = JSON.parse(frame.data);
      } catch {
        continue;
      }
      if (item.seq !== null && item.seq !== undefined) {
        if (item.seq <= this.lastSeq) continue; // seen already: never shown twice
        this.lastSeq = item.seq;
      }
      const shown = this.apply(item.signal, item.payload || {});
      if (shown) await shown; // the frames after it wait (see proc.run.started)
    }
  }

  /** The stream's state, on the transcript for styling and tests: replaying, live, reconnecting. */
  streaming(state) {
    if (!this.closed) $("transcript").dataset.stream = state;
  }

  async refreshProcess() {
    this.process = await api("GET", procPath(this.pid));
    this.onState(this.process);
  }

  async refreshApprovals() {
    const { requests } = await api("GET", procPath(this.pid, "/hil"));
    if (this.closed) return; // another process is open now: these are not its approvals
    const pending = new Set(requests.map((r) => r.request_id));
    for (const [id, card] of this.approvals) if (!pending.has(id)) this.dropApproval(id, card);
    for (const r of requests) {
      const expiresAt = r.expires_at ?? this.expiries.get(r.request_id);
      this.addApproval({
        requestId: r.request_id,
        runId: r.run_id,
        callId: r.tool_call_id,
        name: r.tool_name,
        ...(expiresAt !== undefined ? { expiresAt } : {}),
        ...r,
      });
    }
  }

  /** Read the queue again, one read at a time: a read asked for and not yet begun covers any
   * news that comes meanwhile too. */
  refreshQueue() {
    if (this.queueAsked) return this.queueLoading;
    this.queueAsked = true;
    this.queueLoading = this.queueLoading
      .then(() => {
        this.queueAsked = false;
        return this.loadQueue();
      })
      .catch((err) => {
        if (!this.closed) status(`could not read the queue: ${err.message}`);
      });
    return this.queueLoading;
  }

  async loadQueue() {
    if (this.closed) return;
    const { items } = await api("GET", procPath(this.pid, "/queue"));
    if (this.closed) return; // another process is open now: this is not its queue
    this.queued = new Map(items.map((item) => [item.id, item]));
    const list = $("queue-list");
    list.replaceChildren();
    items.forEach((item, index) => list.append(this.queueItem(item, index + 1)));
    $("queue-count").textContent = String(items.length);
    $("queue").hidden = items.length === 0;
  }

  /** One waiting item: its place in the queue, its kind where it is not a queued message, its text. */
  queueItem(item, position) {
    const row = el("li");
    row.dataset.item = item.id;
    row.dataset.kind = item.kind;
    row.append(el("span", "position", `${position}.`));
    if (item.kind !== "queue") row.append(el("span", "kind", item.kind === "steer" ? "steer" : "event"));
    row.append(el("span", "text", item.text));
    const button = el("button", "withdraw", "Withdraw");
    button.type = "button";
    button.title = "Take it back before it runs";
    button.addEventListener("click", () => this.withdraw(item.id, button));
    row.append(button);
    return row;
  }

  /** Withdraw one waiting item (`id`), or all the user's input (no `id`). A 404 is an item a run
   * took first (or another client withdrew): the read that follows shows which. */
  async withdraw(id, button) {
    if (button) button.disabled = true;
    const path = procPath(this.pid, id === undefined ? "/queue" : `/queue/${id}`);
    try {
      const { withdrawn } = await api("DELETE", path);
      for (const item of withdrawn) this.dropWithdrawn(item);
      status(withdrawn.length === 1 ? "withdrawn: it will not run" : `withdrawn: ${withdrawn.length} messages`);
    } catch (err) {
      if (err instanceof ApiError && err.status === 404) status("not withdrawn: it is no longer waiting");
      else status(`could not withdraw: ${err.message}`);
      if (button) button.disabled = false;
    }
    await this.refreshQueue();
  }

  /** A withdrawn message never runs: its pending bubble goes, and the run block made for it. */
  dropWithdrawn(item) {
    if (this.closed || this.withdrawn.has(item.id)) return; // (told by the answer and by the signal)
    this.withdrawn.add(item.id);
    const run = this.runs.get(item.run_id);
    const scope = run ? run.block : $("transcript");
    const bubble = [...scope.querySelectorAll(".msg.user.pending")].find((b) => b.textContent === item.text);
    if (bubble) bubble.remove();
    if (run && !run.footer.textContent && run.block.children.length === 1) {
      run.block.remove(); // only its empty footer is left: the run will never be
      this.runs.delete(item.run_id);
    }
  }

  /** New persisted messages (by id), in order; calls are serialised so none is rendered twice. */
  loadHistory() {
    this.history = this.history.then(() => this.fetchNewMessages()).catch((err) => status(err.message));
    return this.history;
  }

  /** A reset (made here or by another client) started an empty history, or a rewind cut it back:
   * forget the old one's messages and runs, in the history queue so that no fetch begun before it
   * renders after it (a read queued next shows the history as it is now). */
  forgetHistory() {
    this.history = this.history.then(() => {
      if (this.closed) return;
      this.runs.clear();
      this.messages.clear();
      this.tools.clear();
      $("transcript").replaceChildren();
    });
  }

  /** A rewind cut the history back: show it again as it is now (forget it, read it), in the history
   * queue; the runs still shown keep the outcomes (footers) and the quiet state only their signals
   * told. */
  reshowHistory() {
    const told = new Map(); // runId -> [footer text, status, quiet]
    this.history = this.history.then(() => {
      for (const [id, run] of this.runs) {
        const { footer } = run;
        if (footer.dataset.status) told.set(id, [footer.textContent, footer.dataset.status, run.block.hidden]);
      }
    });
    this.forgetHistory();
    this.loadHistory();
    this.history = this.history.then(() => {
      if (this.closed) return;
      for (const [id, [text, state, hidden]] of told) {
        const run = this.runs.get(id);
        if (!run) continue; // all of it was cut
        run.footer.textContent = text;
        run.footer.dataset.status = state;
        quiet(run, hidden);
      }
      if (this.retryOffer !== null) this.offerRetry(this.retryOffer); // (gone if its run was cut)
    });
    return this.history;
  }

  async fetchNewMessages() {
    const fresh = [];
    let before = null;
    for (let page = 0; page < 10; page++) {
      const query = before === null ? "limit=200" : `limit=200&before=${before}`;
      const data = await api("GET", procPath(this.pid, `/messages?${query}`));
      if (this.closed) return; // another process is open now: the transcript is its
      const unseen = data.messages.filter((m) => !this.messages.has(m.id));
      fresh.push(...unseen);
      if (data.next_before === null || unseen.length < data.messages.length) break;
      before = data.next_before;
    }
    fresh.sort((a, b) => a.id - b.id);
    for (const m of fresh) {
      if (this.messages.has(m.id)) continue;
      this.messages.add(m.id);
      this.renderMessage(m);
    }
    if (fresh.length) scrollDown();
  }

  run(runId, create = true) {
    let run = this.runs.get(runId);
    if (!run && create) {
      const block = el("section", "run");
      block.dataset.run = runId || "";
      const footer = el("div", "notice footer");
      block.append(footer);
      $("transcript").append(block);
      run = { block, footer, live: [], current: null };
      this.runs.set(runId, run);
    }
    return run;
  }

  /** Append a node to a run, before its footer. */
  put(run, node) {
    run.block.insertBefore(node, run.footer);
    for (const bubble of run.live) run.block.insertBefore(bubble, run.footer); // streaming stays last
    return node;
  }

  renderMessage({ id, run_id: runId, message }) {
    const run = this.run(runId);
    const role = message.role;
    if (role === "user") {
      const text = textOf(message.content);
      const bubble = el("div", "msg user", text);
      bubble.dataset.id = id;
      this.dropPending(text);
      // (beside the bubble, not in it: a bubble's text is matched against what was sent)
      const speaker = speakerOf(message);
      if (speaker) {
        const name = el("div", "speaker", speaker);
        name.dataset.for = String(id);
        if (message.origin.user && message.origin.user !== speaker) name.title = message.origin.user;
        this.put(run, name);
      }
      this.put(run, bubble);
      this.put(run, this.messageActions(id, plainText(message.content)));
    } else if (role === "assistant") {
      for (const block of message.content || []) {
        if (block.type === "text" && block.text) {
          const bubble = el("div", "msg assistant", block.text);
          bubble.dataset.id = id;
          // This text was streamed: the oldest finished stream bubble of the run is it.
          const streamed = run.live.find((b) => b.dataset.sealed) || run.live[0];
          if (streamed && streamed.dataset.sealed) bubble.dataset.claimed = "1";
          if (streamed) this.dropLive(run, streamed);
          this.put(run, bubble);
        } else if (block.type === "thinking" && block.thinking) {
          this.put(run, el("div", "msg assistant thinking", block.thinking));
        } else if (block.type === "toolCall") {
          this.put(run, this.toolCard(block.id, block.name, block.arguments));
          // a card the call's signals showed first moves after its message's text: its retry lines with it
          for (const line of run.block.querySelectorAll(".notice.tool-retry")) {
            if (line.dataset.call === block.id) this.put(run, line);
          }
        }
      }
      if (message.stopReason === "error" || message.stopReason === "aborted") {
        const why = message.errorMessage ? `: ${message.errorMessage}` : "";
        this.put(run, el("div", "msg assistant error", `${message.stopReason}${why}`));
      }
    } else if (role === "toolResult") {
      const card = this.toolCard(message.toolCallId, message.toolName, undefined);
      this.finishTool(card, !message.isError, textOf(message.content));
      if (!card.isConnected) this.put(run, card); // it stays where its call is
    } else {
      this.put(run, el("div", "msg system", textOf(message.content) || pretty(message)));
    }
  }

  /** The actions under one of the user's messages: fork the conversation from just before it, or
   * rewind this one to just before it; either way the message goes in the composer to edit. */
  messageActions(id, text) {
    const bar = el("div", "msg-actions");
    bar.dataset.for = String(id);
    const button = el("button", "fork-here", "Fork from here");
    button.type = "button";
    button.title = "A new conversation up to just before this message, with the message in the composer to edit";
    button.addEventListener("click", () => this.forkBefore(id, text, button));
    const rewind = el("button", "rewind-here", "Rewind & edit");
    rewind.type = "button";
    rewind.title =
      "Cut this conversation back to just before this message (this message and what follows are archived), " +
      "and put the message in the composer to edit and send again";
    rewind.disabled = this.rewinding; // (rendered again while a rewind asked for here is under way)
    rewind.addEventListener("click", () => this.rewindBefore(id, text));
    bar.append(button, rewind);
    return bar;
  }

  /** Rewind this process to the message before message `id` (read now: the history may have
   * changed since the page showed it; the first message has none, so back to the start, 0), after
   * a confirm; the rewind actions wait meanwhile. The transcript follows the rewind's signal. */
  async rewindBefore(id, text) {
    if (!this.onRewind || this.rewinding) return;
    const ask =
      "Rewind this conversation to just before this message? The message and everything after it are " +
      "archived and removed; the message goes back in the composer to edit and send again.";
    if (!confirm(ask)) return;
    this.rewinding = true;
    const buttons = () => $("transcript").querySelectorAll(".msg-actions .rewind-here");
    for (const b of buttons()) b.disabled = true;
    status("rewinding…");
    try {
      const { messages } = await api("GET", procPath(this.pid, `/messages?limit=1&before=${encodeURIComponent(id)}`));
      if (this.closed) return;
      await this.onRewind(messages.length ? messages[messages.length - 1].id : 0, text);
    } catch (err) {
      if (!this.closed) status(`could not rewind: ${err.message}`);
    } finally {
      this.rewinding = false;
      for (const b of buttons()) b.disabled = false;
    }
  }

  /** Show the Retry action under run `runId`'s footer (null: under none): the last run, which ended
   * without an answer. One at most: any other goes. Beside the footer, not in it (its text is the
   * run's outcome). */
  offerRetry(runId) {
    for (const bar of $("transcript").querySelectorAll(".retry-bar")) bar.remove();
    const run = runId === null ? undefined : this.runs.get(runId);
    this.retryOffer = run ? runId : null;
    if (!run) return;
    const bar = el("div", "retry-bar");
    bar.dataset.run = runId;
    const button = el("button", "retry-run", "Retry");
    button.type = "button";
    button.title =
      "Run the model again where this run ended without an answer " +
      "(its failure notice or cut-off answer is archived and removed)";
    button.addEventListener("click", () => this.retry(button));
    bar.append(button);
    run.block.append(bar); // (after the footer: put() inserts before it)
  }

  /** Ask the server to run the model again where the last run ended without an answer. The
   * transcript follows the retry's signals (the failed end goes, the new run shows); a refusal is
   * said on the status line and the action can be used again. */
  async retry(button) {
    button.disabled = true;
    try {
      await api("POST", procPath(this.pid, "/retry"), {});
      if (!this.closed) status("retrying…");
    } catch (err) {
      if (this.closed) return;
      if (err instanceof ApiError && err.code === "busy") status("not retried: a run is active");
      else if (err instanceof ApiError && err.code === "nothing_to_retry") status(`not retried: ${err.message}`);
      else status(`could not retry: ${err.message}`);
      button.disabled = false;
    }
  }

  /** Fork up to the message before message `id` (read now: the history may have changed since
   * the page showed it); the first message has nothing before it, so there is nothing to fork. */
  async forkBefore(id, text, button) {
    if (!this.onFork) return;
    button.disabled = true;
    try {
      const { messages } = await api("GET", procPath(this.pid, `/messages?limit=1&before=${encodeURIComponent(id)}`));
      if (this.closed) return;
      if (!messages.length) {
        status("cannot fork here: there is nothing before the first message (use Fork for the whole conversation)");
        return;
      }
      await this.onFork(messages[messages.length - 1].id, text);
    } catch (err) {
      if (!this.closed) status(`could not fork: ${err.message}`);
    } finally {
      button.disabled = false;
    }
  }

  toolCard(callId, name, args) {
    let card = this.tools.get(callId);
    if (!card) {
      card = el("div", "tool running");
      card.dataset.call = callId;
      const head = el("div");
      // The approval request may have come before the history that shows the call.
      const asked = [...this.approvals.values()].some((a) => a.dataset.call === callId);
      head.append(el("span", "name", name), el("span", "state", asked ? " waiting for approval" : " running…"));
      card.append(head, el("pre", "args"), el("pre", "output"));
      this.tools.set(callId, card);
    }
    if (args !== undefined) card.querySelector(".args").textContent = pretty(args);
    return card;
  }

  /** A running call's output as it comes ({delta, skipped?} updates): appended to its card,
   * only the newest LIVE_OUTPUT characters kept, until the result takes its place. */
  streamTool(card, update) {
    if (!update || typeof update.delta !== "string") return;
    const output = card.querySelector(".output");
    let text = output.textContent;
    if (Number.isInteger(update.skipped) && update.skipped > 0) {
      text += `${text && !text.endsWith("\n") ? "\n" : ""}… ${update.skipped} characters skipped …\n`;
    }
    text += update.delta;
    if (text.length > LIVE_OUTPUT) text = `…${text.slice(-LIVE_OUTPUT)}`;
    output.textContent = text;
    output.scrollTop = output.scrollHeight;
    card.classList.add("streaming");
    scrollDown();
  }

  finishTool(card, ok, output) {
    card.className = `tool ${ok ? "ok" : "failed"}`;
    card.querySelector(".state").textContent = ok ? " finished" : " failed";
    card.querySelector(".output").textContent = output ?? "";
  }

  liveBubble(run) {
    if (!run.current) {
      run.current = el("div", "msg assistant live");
      run.live.push(run.current);
      this.put(run, run.current);
    }
    return run.current;
  }

  /** Text deltas are never replayed, so those sent while the stream was down are lost: each
   * unfinished bubble says so, instead of joining what follows to what came before as if it were
   * one text. (proc.run.output brings the whole text.) */
  markGaps() {
    for (const run of this.runs.values()) {
      if (run.current && !run.current.textContent.endsWith(GAP)) run.current.textContent += GAP;
    }
  }

  seal(run) {
    if (run.current) run.current.dataset.sealed = "1";
    run.current = null;
  }

  dropLive(run, bubble) {
    run.live = run.live.filter((b) => b !== bubble);
    if (run.current === bubble) run.current = null;
    bubble.remove();
  }

  notice(run, text) {
    const node = el("div", "notice", text);
    if (run) this.put(run, node);
    else $("transcript").append(node);
    scrollDown();
  }

  addPending(runId, text) {
    if (this.closed) return; // sent before the user switched away: the history shows it there
    const run = this.run(runId);
    const already = [...run.block.querySelectorAll(".msg.user:not(.pending)")].some((b) => b.textContent === text);
    if (!already) this.put(run, el("div", "msg user pending", text));
    scrollDown();
  }

  dropPending(text) {
    const pending = [...$("transcript").querySelectorAll(".msg.user.pending")].find((b) => b.textContent === text);
    if (pending) pending.remove();
  }

  /** One signal. During the backlog, runs whose messages are gone (reset, compacted) are skipped.
   * A promise when the stream's next frames must wait for what it started (a history read). */
  apply(signal, p) {
    const current = this.process && p.runId === this.process.run_id;
    const run = p.runId === undefined ? null : this.run(p.runId, this.live || current);
    switch (signal) {
      case "proc.run.stream":
        if (run && p.event === "text_delta" && typeof p.delta === "string") {
          this.liveBubble(run).textContent += p.delta;
          scrollDown();
        }
        break;
      case "proc.run.retrying":
        // The failed model call is made again from its start: what it had streamed is void.
        if (run && run.current) this.dropLive(run, run.current);
        if (this.live) {
          status(p.fallback ? `switching to ${p.model}: ${p.reason}` : `model retry ${p.attempt}: ${p.reason}`);
        }
        break;
      case "proc.run.tool.retry.scheduled":
      case "proc.run.tool.retry.exhausted":
        // logged after the step whose failed call it counts (the replay: after the whole history
        // of the run is shown): a line in the run right under that call's card, where it is shown
        if (run) {
          const line = el("div", "notice tool-retry", toolRetryLine(signal, p));
          line.dataset.call = p.callId || "";
          const card = this.tools.get(p.callId);
          if (card && card.parentNode === run.block) card.after(line);
          else this.put(run, line);
          scrollDown();
        }
        break;
      case "proc.run.output":
        if (run && p.quiet) {
          quiet(run, true); // a heartbeat's "nothing to do"
          break;
        }
        if (run && p.text) {
          quiet(run, false);
          // The full text of what was streamed. If its message is already rendered, it is that one.
          const persisted = [...run.block.querySelectorAll(".msg.assistant[data-id]:not([data-claimed])")].find(
            (b) => b.textContent === p.text,
          );
          if (persisted) {
            persisted.dataset.claimed = "1";
            if (run.current) this.dropLive(run, run.current);
          } else {
            this.liveBubble(run).textContent = p.text;
            this.seal(run);
          }
        }
        break;
      case "proc.run.tool.started":
        if (run) {
          this.seal(run);
          const card = this.toolCard(p.callId, p.name, p.args);
          if (!card.isConnected) this.put(run, card);
          this.resolveCall(p.callId);
        }
        break;
      case "proc.run.tool.update":
        // Live-only progress of a running call (Shell's output as it comes); its result replaces it.
        if (run) {
          const card = this.tools.get(p.callId);
          if (card && card.classList.contains("running")) this.streamTool(card, p.update);
        }
        break;
      case "proc.run.tool.finished":
        if (run) {
          const card = this.toolCard(p.callId, p.name, undefined);
          if (!card.classList.contains("running") && !this.live) break; // the history had its result
          this.finishTool(card, p.ok, p.ok ? p.output : p.error ?? p.output);
          if (!card.isConnected) this.put(run, card);
          this.resolveCall(p.callId, !p.ok && p.error === TIMED_OUT ? "timed out" : undefined);
        }
        break;
      case "proc.run.hil.requested":
        if (this.live) this.addApproval(p);
        // (the backlog: the pending requests are read next, without their deadlines)
        else if (typeof p.expiresAt === "number") this.expiries.set(p.requestId, p.expiresAt);
        break;
      case "proc.run.started":
        if (run && p.reason === "heartbeat") quiet(run, true); // shown once it has something to say
        this.offerRetry(null); // a later run: the one before it is no longer the last
        if (this.live) {
          this.refreshProcess().catch(() => {});
          this.refreshQueue(); // it may have taken the next waiting item
          // The input that started the run is in the history already (committed with this signal),
          // and nothing else says so until the run's answer is: read it now, and hold the stream's
          // next frames until it is shown, so that the run's output never shows before the message
          // it answers (the sender's pending bubble waits for the POST's receipt, which may come
          // after the whole run on a loaded machine; another client's message has none).
          return this.loadHistory();
        }
        break;
      case "proc.run.finished":
        if (run) {
          quiet(run, !!p.quiet); // a check-in that failed or was aborted is shown, with its footer
          this.seal(run);
          run.footer.textContent = `run finished: ${p.status}${p.reason ? ` (${p.reason})` : ""}`;
          run.footer.dataset.status = p.status;
          for (const [id, card] of this.approvals) if (card.dataset.run === p.runId) this.dropApproval(id, card);
        }
        // ended without an answer (a failure, an abort, cut off at the output limit): it may be retried
        this.offerRetry(p.status === "error" || p.status === "aborted" || p.reason === "length" ? p.runId : null);
        if (this.live) {
          this.refreshProcess().catch(() => {});
          this.refreshQueue(); // an abort may have dropped what waited
        }
        scrollDown();
        break;
      case "proc.compacted":
        if (run) {
          const what = p.kind === "clearing" ? `${p.cleared} old tool outputs cleared` : `${p.removed} older messages summarised`;
          this.notice(run, `context compacted: ${what} (${p.tokensBefore} → ${p.tokensAfter} tokens)`);
        }
        if (this.live) this.refreshProcess().catch(() => {}); // the context meter falls
        break;
      case "proc.changed": {
        const changes = p.changes || [];
        // In the backlog, a reset is older than the history already shown: only a live one clears.
        if (this.live && changes.includes("reset")) {
          this.offerRetry(null);
          this.forgetHistory();
        }
        // So is a rewind: a live one drops what is shown after its message by showing the history
        // again, read after it, and the stream's next frames (a run on the rewound history) wait.
        // A retry drops the failed end of the last run alike (the run on what is left follows).
        const cut = (what) => what && typeof what === "object";
        const retried = this.live && cut(p.retried);
        const rewound = this.live && (cut(p.rewound) || retried);
        if (retried) this.offerRetry(null); // under way: its run's signals come next
        if (rewound) this.reshowHistory();
        else if (changes.includes("messages")) this.loadHistory();
        if (this.live && changes.includes("hil")) this.refreshApprovals().catch(() => {});
        // the title, the context's level (the header's meter) or the threshold it is measured against
        const header = ["title", "context", "compaction", "reset", "model"];
        // (a rewind forgot the context's reading: the meter shows the process's own again)
        if (this.live && (rewound || changes.some((c) => header.includes(c)))) this.refreshProcess().catch(() => {});
        if (this.live && (changes.includes("queue") || changes.includes("reset"))) {
          for (const id of p.withdrawn || []) if (this.queued.has(id)) this.dropWithdrawn(this.queued.get(id));
          this.refreshQueue();
        }
        if (rewound) return this.history;
        break;
      }
      case "proc.log.pruned":
        // What the missed signals told is in the history and the process's state: read them again.
        this.loadHistory();
        if (this.live) {
          this.refreshProcess().catch(() => {});
          this.refreshApprovals().catch(() => {});
          this.refreshQueue();
        }
        break;
      default:
        break;
    }
  }

  addApproval(p) {
    if (this.approvals.has(p.requestId)) return;
    const card = el("div", "approval");
    card.dataset.request = p.requestId;
    card.dataset.run = p.runId;
    card.dataset.call = p.callId;
    card.dataset.tool = p.name || "";
    const tags = p.tags && p.tags.length ? ` [${p.tags.join(", ")}]` : "";
    card.append(el("strong", null, `Approve ${p.name}?`), el("span", null, tags), el("div", "reason", p.reason));
    card.append(el("pre", null, pretty(p.args)));
    if (typeof p.expiresAt === "number" && Number.isFinite(p.expiresAt)) this.countDown(p.requestId, card, p.expiresAt);
    const buttons = el("div", "buttons");
    // Sent with Deny only: the model reads it as the user's words in the denied call's result.
    const reason = el("input", "hil-reason");
    reason.type = "text";
    reason.maxLength = 2000;
    reason.placeholder = "Reason for the model (sent with Deny)";
    reason.setAttribute("aria-label", "Reason for the model, sent with Deny");
    const choices = [
      ["approve", "Approve", false],
      ["deny", "Deny", false],
      ["approve", "Always", true],
    ];
    for (const [decision, label, remember] of choices) {
      const button = el("button", `hil-${label.toLowerCase()}`, label);
      button.type = "button";
      button.addEventListener("click", () => this.answer(p.requestId, card, decision, remember));
      buttons.append(button);
    }
    reason.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.isComposing) this.answer(p.requestId, card, "deny", false);
    });
    const edit = el("button", "hil-edit", "Edit");
    edit.type = "button";
    edit.title = "Approve with arguments of your own instead of the model's";
    buttons.append(edit, reason);
    card.append(buttons, this.argumentsEditor(p, card, edit));
    this.approvals.set(p.requestId, card);
    $("approvals").append(card);
    const tool = this.tools.get(p.callId);
    if (tool && tool.classList.contains("running")) tool.querySelector(".state").textContent = " waiting for approval";
  }

  /** Edit: the call's arguments as JSON in a textarea (hidden until Edit is clicked), approved as
   * edited; what the server refuses (400: not the tool's schema, or the policy denies them) is
   * said under it, the request still pending. */
  argumentsEditor(p, card, edit) {
    const editor = el("div", "hil-editor");
    editor.hidden = true;
    const args = el("textarea", "hil-args");
    args.value = JSON.stringify(p.args && typeof p.args === "object" ? p.args : {}, null, 2);
    args.rows = Math.min(12, args.value.split("\n").length + 1);
    args.spellcheck = false;
    args.setAttribute("aria-label", `Arguments of ${p.name || "the call"}, as JSON`);
    const send = el("button", "hil-approve-edited", "Approve edited");
    send.type = "button";
    const error = el("div", "hil-error error");
    error.setAttribute("role", "alert");
    edit.addEventListener("click", () => {
      editor.hidden = !editor.hidden;
      if (!editor.hidden) args.focus();
    });
    send.addEventListener("click", () => {
      let edited;
      try {
        edited = JSON.parse(args.value);
      } catch (err) {
        error.textContent = `not JSON: ${err.message}`;
        return;
      }
      if (!edited || typeof edited !== "object" || Array.isArray(edited)) {
        error.textContent = "the arguments must be a JSON object";
        return;
      }
      this.answer(p.requestId, card, "approve", false, edited);
    });
    editor.append(args, send, error);
    return editor;
  }

  async answer(requestId, card, decision, remember, edited) {
    const controls = card.querySelectorAll("button, input, textarea");
    for (const c of controls) c.disabled = true;
    const body = { decision, remember };
    const message = card.querySelector(".hil-reason").value.trim();
    if (decision === "deny" && message) body.message = message;
    if (edited !== undefined) body.arguments = edited;
    const error = card.querySelector(".hil-error");
    if (error) error.textContent = "";
    try {
      const path = procPath(this.pid, `/hil/${encodeURIComponent(requestId)}`);
      await api("POST", path, body);
      this.dropApproval(requestId, card, "answered");
    } catch (err) {
      if (err instanceof ApiError && err.status === 404) this.dropApproval(requestId, card); // answered elsewhere
      else {
        // a refused edit is said where it was made; anything else on the status line
        if (edited !== undefined && error && err instanceof ApiError && err.status === 400) {
          error.textContent = err.message;
        } else status(`could not answer: ${err.message}`);
        for (const c of controls) c.disabled = false; // still pending: answer again
      }
    }
  }

  /** The time left to answer, updated each second, until the server denies the request itself. */
  countDown(requestId, card, expiresAt) {
    card.dataset.expiresAt = String(expiresAt);
    const line = el("div", "expires");
    const tick = () => {
      const left = expiresAt - Date.now() / 1000;
      const text = left > 0 ? `denied automatically in ${clock(left)}` : "not answered in time: denying…";
      if (line.textContent !== text) line.textContent = text;
      card.classList.toggle("urgent", left <= 30);
    };
    tick();
    this.countdowns.set(requestId, setInterval(tick, 250)); // (a whole second's tick could lag a second)
    card.append(line);
  }

  /** A request no longer pending: its card goes. One that was not answered here and is gone at its
   * deadline was denied by the server for want of an answer: the card stays, saying so, until
   * dismissed. (`how`: "answered", this page's answer was taken; "timed out", the server said so.) */
  dropApproval(requestId, card, how) {
    this.approvals.delete(requestId);
    const timer = this.countdowns.get(requestId);
    if (timer !== undefined) clearInterval(timer);
    this.countdowns.delete(requestId);
    const expiresAt = Number(card.dataset.expiresAt);
    const late = how !== "answered" && expiresAt && Date.now() / 1000 >= expiresAt - SKEW;
    if (how === "timed out" || late) this.expired(card);
    else card.remove();
    const tool = this.tools.get(card.dataset.call);
    if (tool && tool.classList.contains("running")) {
      tool.querySelector(".state").textContent = card.isConnected ? " denied: not answered in time" : " running…";
    }
  }

  /** The final state of a card the server denied because nobody answered in time. */
  expired(card) {
    card.classList.add("expired");
    card.classList.remove("urgent");
    for (const node of card.querySelectorAll(".buttons, .hil-editor")) node.remove();
    const line = card.querySelector(".expires") || card.appendChild(el("div", "expires"));
    line.textContent = "Denied: not answered in time.";
    const dismiss = el("button", "dismiss", "Dismiss");
    dismiss.type = "button";
    dismiss.addEventListener("click", () => card.remove());
    card.append(dismiss);
    const run = this.runs.get(card.dataset.run);
    const name = card.dataset.tool || "a call";
    if (run) this.notice(run, `approval of ${name} not answered in time: denied automatically`);
  }

  resolveCall(callId, how) {
    for (const [id, card] of this.approvals) if (card.dataset.call === callId) this.dropApproval(id, card, how);
  }
}
