// agentloop web UI: a chat client for durable processes, over the authenticated /v1 API.
// The page: sign-in, the process list, the composer and the process actions. No build step:
// plain ES modules served by `agentloop serve` (server/web.py).

import { api, ApiError, onUnauthorized, procPath, sse, tokenStore } from "./api.js";
import { $, el, sleep, status } from "./dom.js";
import { ProcessView } from "./view.js";

const PID_KEY = "agentloop.pid"; // the open process, reopened after a reload (not a secret)

let view = null;
let inbox = null; // the approvals inbox's AbortController, until sign-out

function signOut(message) {
  tokenStore.clear();
  if (view) view.close();
  view = null;
  if (inbox) inbox.abort();
  inbox = null;
  $("inbox").hidden = true;
  $("main").hidden = true;
  $("signin").hidden = false;
  $("signin-error").textContent = message || "";
}

async function signIn(token) {
  tokenStore.set(token);
  const me = await api("GET", "/v1/me");
  $("who").textContent = `${me.account}${me.admin ? " (admin)" : ""}`;
  $("signin").hidden = true;
  $("main").hidden = false;
  await listProcesses();
  followInbox();
  const last = sessionStorage.getItem(PID_KEY);
  if (last) await openProcess(last).catch(() => sessionStorage.removeItem(PID_KEY));
}

const expanded = new Set(); // the parents whose subagents the list shows (collapsed by default)

/** The account's processes, each subagent (parent_pid set) indented under its parent, behind a
 * toggle on the parent; one whose parent is not listed (killed) is shown at the top level. */
async function listProcesses() {
  const { processes } = await api("GET", "/v1/processes");
  const listed = new Set(processes.map((p) => p.pid));
  const children = new Map();
  const top = [];
  for (const p of processes) {
    if (p.parent_pid && p.parent_pid !== p.pid && listed.has(p.parent_pid)) {
      if (!children.has(p.parent_pid)) children.set(p.parent_pid, []);
      children.get(p.parent_pid).push(p);
    } else top.push(p);
  }
  const list = $("processes");
  list.replaceChildren();
  const add = (p, depth) => {
    const item = el("li");
    item.dataset.pid = p.pid;
    item.title = p.pid; // the pid as its tooltip: the list shows the process's title
    item.append(el("span", "name"));
    if (depth > 0) {
      item.dataset.parent = p.parent_pid;
      item.dataset.depth = String(depth);
      item.style.setProperty("--depth", String(depth));
    }
    const kids = children.get(p.pid) || [];
    if (kids.length) {
      const toggle = el("button", "subagents");
      toggle.type = "button";
      toggle.dataset.count = String(kids.length);
      toggle.addEventListener("click", (event) => {
        event.stopPropagation(); // folding is not opening
        if (!expanded.delete(p.pid)) expanded.add(p.pid);
        fold();
      });
      item.append(toggle);
    }
    item.append(el("span", "state", p.state));
    list.append(item);
    retitle(p.pid, p.title);
    if (view && view.pid === p.pid) item.classList.add("selected");
    item.addEventListener("click", () => openProcess(p.pid).catch((err) => status(err.message)));
    for (const kid of kids) add(kid, depth + 1);
  };
  for (const p of top) add(p, 0);
  fold();
}

/** Show the subagents of the expanded parents (whose own parents are shown), hide the others. */
function fold() {
  for (const item of $("processes").children) {
    const parent = item.dataset.parent ? listItem(item.dataset.parent) : null;
    item.hidden = parent !== null && (parent.hidden || !expanded.has(parent.dataset.pid));
    const toggle = item.querySelector(":scope > .subagents");
    if (toggle) {
      const open = expanded.has(item.dataset.pid);
      const n = Number(toggle.dataset.count);
      toggle.textContent = `${open ? "▾" : "▸"} ${n} subagent${n === 1 ? "" : "s"}`;
      toggle.setAttribute("aria-expanded", String(open));
    }
  }
}

/** Expand the parents of `pid`'s item, so an open subagent is not hidden in the list. */
function reveal(pid) {
  for (let item = listItem(pid); item && item.dataset.parent; item = listItem(item.dataset.parent)) {
    expanded.add(item.dataset.parent);
  }
}

/** The process list's item for `pid`, or null while the list does not have it. */
function listItem(pid) {
  return $("processes").querySelector(`li[data-pid="${CSS.escape(pid)}"]`);
}

/** Show a process's title in the list (its pid while it has none) and, if it is open, the header. */
function retitle(pid, title) {
  const item = listItem(pid);
  if (item) {
    item.querySelector(".name").textContent = title || pid;
    item.classList.toggle("titled", !!title);
  }
  if (view && view.pid === pid) $("proc-name").textContent = title || "";
  return item !== null;
}

/** A title change on the account stream renames its process; whether that was all it said. A
 * process the list does not have yet (started elsewhere) brings the list up to date. */
function retitled(frame) {
  let item;
  try {
    item = JSON.parse(frame.data);
  } catch {
    return false;
  }
  const changes = (item.payload && item.payload.changes) || [];
  if (item.signal !== "proc.changed" || !changes.includes("title")) return false;
  if (!retitle(item.pid, item.payload.title)) listProcesses().catch(() => {});
  return changes.length === 1;
}

// The approvals inbox: what every process of the account waits for, also those the page does not
// show (a schedule's run, a subagent's). The inbox is read whole (GET /v1/approvals) at each
// (re)connection of the account stream (GET /v1/events) and whenever it says an approval was asked or
// answered, or a run ended: a read is one small request, simpler than resuming the stream by its ids.

function followInbox() {
  if (inbox) inbox.abort();
  const stop = new AbortController();
  inbox = stop;
  let queued = false;
  let loading = Promise.resolve();
  const refresh = () => {
    if (queued) return; // a read not yet begun covers this news too
    queued = true;
    loading = loading
      .then(() => {
        queued = false;
        return loadInbox(stop);
      })
      .catch(() => {});
  };
  followAccount(stop, refresh);
}

async function followAccount(stop, refresh) {
  while (!stop.signal.aborted) {
    try {
      for await (const frame of sse("/v1/events", null, stop.signal, refresh)) if (!retitled(frame)) refresh();
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) return;
    }
    if (!stop.signal.aborted) await sleep(1000); // the server ended it (restart, shutdown): reconnect
  }
}

async function loadInbox(stop) {
  const { requests } = await api("GET", "/v1/approvals");
  if (stop.signal.aborted) return; // signed out meanwhile
  const list = $("inbox-list");
  list.replaceChildren();
  for (const r of requests) {
    const item = el("li", null, r.tool_name);
    item.dataset.pid = r.pid;
    item.dataset.request = r.request_id;
    item.title = r.reason || r.syscall;
    item.append(el("span", "pid", r.pid));
    item.addEventListener("click", () => openFromInbox(r.pid).catch((err) => status(err.message)));
    list.append(item);
  }
  $("inbox-count").textContent = String(requests.length);
  $("inbox").hidden = requests.length === 0;
}

/** Open a process the inbox names; one started elsewhere is not in the list yet. */
async function openFromInbox(pid) {
  if (!listItem(pid)) await listProcesses();
  await openProcess(pid);
}

/** The header's meter of how full the open process's context window is (GET …/processes/<pid>
 * answers it as context_pressure), styled by its level: ok, warn, critical or full. */
function showContext(pressure) {
  const box = $("context");
  box.hidden = !pressure;
  if (!pressure) return;
  box.dataset.level = pressure.level;
  $("context-label").textContent = `context ${Math.round(pressure.ratio * 100)}% · ${pressure.level}`;
  const meter = $("context-meter");
  meter.high = Math.min(0.85, pressure.threshold); // critical from here (see ContextOut)
  meter.value = Math.min(1, pressure.ratio);
  const tokens = `${pressure.tokens.toLocaleString()} of ${pressure.window.toLocaleString()} tokens`;
  box.title = `${tokens}; compacts at ${Math.round(pressure.threshold * 100)}%`;
}

let shownModel = null; // the open process's model choice, as last shown

/** The header's model: the one the next answer uses, and whose choice it is (the process's own,
 * the account's model.json, or the server's default). */
function showModel(choice) {
  $("model-box").hidden = !choice;
  if (!choice) {
    closeModelForm();
    return;
  }
  const reasoning = choice.source === "process" && choice.reasoning ? ` (${choice.reasoning})` : "";
  $("model").textContent = `${choice.source} · ${choice.effective}${reasoning}`;
  const whose = { process: "this conversation's own", account: "the account's", default: "the server's default" };
  const by = whose[choice.source] || choice.source;
  $("model-edit").title = `Next answer: ${choice.effective}${reasoning}, ${by}. Click to change.`;
  shownModel = choice;
}

let catalogAsked = false; // the model catalog fills the picker's suggestions once

/** Offer the models the server knows (GET /v1/models) as the picker's suggestions: those it can
 * call first, then the others with what they need. Any provider:model may still be typed. */
async function loadCatalog() {
  if (catalogAsked) return;
  catalogAsked = true;
  try {
    const { models } = await api("GET", "/v1/models");
    const ordered = models.filter((m) => m.usable).concat(models.filter((m) => !m.usable));
    $("model-options").replaceChildren(
      ...ordered.map((m) => {
        const option = document.createElement("option");
        option.value = m.model;
        option.label = m.usable ? `${m.context_window.toLocaleString()} tokens` : m.why;
        return option;
      }),
    );
  } catch {
    catalogAsked = false; // (asked again the next time the form opens)
  }
}

function openModelForm() {
  loadCatalog();
  $("model-spec").value = (shownModel && shownModel.model) || "";
  $("model-reasoning").value = (shownModel && shownModel.model && shownModel.reasoning) || "";
  $("model-error").textContent = "";
  $("model-form").hidden = false;
  $("model-edit").setAttribute("aria-expanded", "true");
  $("model-spec").focus();
}

function closeModelForm() {
  $("model-form").hidden = true;
  $("model-error").textContent = "";
  $("model-edit").setAttribute("aria-expanded", "false");
}

/** Set the open process's model (`spec` null: back to the account's or the server's), from its
 * next run on. A refusal is shown in the form, and the model stays as it was. */
async function setModel(spec, reasoning) {
  if (!view) return;
  const pid = view.pid;
  const body = { model: spec };
  if (spec !== null && reasoning) body.reasoning = reasoning;
  for (const id of ["model-apply", "model-reset"]) $(id).disabled = true;
  try {
    const choice = await api("POST", procPath(pid, "/model"), body);
    if (!view || view.pid !== pid) return;
    showModel(choice);
    closeModelForm();
    const now = `${choice.effective} (${choice.source})`;
    status(spec === null ? `model: back to ${now}; from the next answer on` : `model: ${now} from the next answer on`);
  } catch (err) {
    if (view && view.pid === pid) $("model-error").textContent = err.message;
  } finally {
    for (const id of ["model-apply", "model-reset"]) $(id).disabled = false;
  }
}

/** Fork the open process: up to message `at` (undefined: all of it), open the fork, and put
 * `text` (the message it was forked before) in the composer to edit and send again. */
async function fork(at, text) {
  if (!view) return;
  const pid = view.pid;
  $("fork").disabled = true;
  status("forking…");
  try {
    const made = await api("POST", procPath(pid, "/fork"), at === undefined ? {} : { at });
    await listProcesses();
    await openProcess(made.pid);
    if (text) {
      $("text").value = text;
      $("text").focus();
    }
    status(text ? "forked: edit the message and send it" : `forked from ${pid}`);
  } catch (err) {
    status(`could not fork: ${err.message}`);
  } finally {
    $("fork").disabled = !view;
  }
}

/** Rewind the open process in place to message `at` (0: back to the start; what follows is
 * archived), and put `text` (the message it was rewound before) in the composer to edit and send
 * again. The transcript drops what was cut when the rewind's signal comes (view.js). A run under way
 * refuses it (409: abort first); a point inside a tool call batch too (400, the server names the
 * valid points). */
async function rewind(at, text) {
  if (!view) return;
  const pid = view.pid;
  try {
    const done = await api("POST", procPath(pid, "/rewind"), { at });
    if (!view || view.pid !== pid) return; // another process is open now: its composer is not this
    if (text) {
      $("text").value = text;
      $("text").focus();
    }
    const archived = done.removed === 1 ? "1 message archived" : `${done.removed} messages archived`;
    status(`rewound (${archived}): edit the message and send it`);
  } catch (err) {
    if (view && view.pid !== pid) return;
    if (err instanceof ApiError && err.status === 409) status("not rewound: a run is active (abort it first)");
    else status(`could not rewind: ${err.message}`);
  }
}

function showProcess(process) {
  const has = process !== null;
  $("proc-title").textContent = has ? process.pid : "No process selected";
  $("proc-state").textContent = has ? (process.run_id ? `running ${process.run_id}` : process.state) : "";
  for (const id of ["abort", "compact", "fork", "reset", "kill", "send", "text"]) $(id).disabled = !has;
  $("abort").disabled = !has || !process.run_id;
  const item = has ? listItem(process.pid)?.querySelector(".state") : null;
  if (item) item.textContent = process.state;
  $("proc-name").textContent = "";
  if (has) retitle(process.pid, process.title);
  showContext(has ? process.context_pressure : null);
  showModel(has && process.model ? process.model : null);
}

async function openProcess(pid) {
  if (view) view.close();
  closeModelForm();
  shownModel = null;
  view = new ProcessView(
    pid,
    (process) => {
      if (view && view.pid === pid) showProcess(process);
    },
    (at, text) => fork(at, text),
    (at, text) => rewind(at, text),
  );
  sessionStorage.setItem(PID_KEY, pid); // a reload reopens it; it is not a secret
  for (const li of $("processes").children) li.classList.toggle("selected", li.dataset.pid === pid);
  reveal(pid);
  fold();
  await view.open();
}

async function send() {
  const text = $("text").value;
  if (!view || !text.trim()) return;
  const mode = $("mode").value;
  const current = view;
  $("send").disabled = true;
  try {
    const receipt = await api("POST", procPath(current.pid, "/messages"), { text, mode });
    $("text").value = "";
    current.addPending(receipt.run_id, text);
    status(receipt.queued ? `queued (position ${receipt.position})` : `sent (${mode})`);
  } catch (err) {
    status(`not sent: ${err.message}`);
  } finally {
    $("send").disabled = false;
  }
}

async function act(what) {
  if (!view) return;
  const pid = view.pid;
  try {
    if (what === "abort") {
      const { aborted } = await api("POST", procPath(pid, "/abort"), {});
      status(aborted ? "run aborted" : "no run to abort");
    } else if (what === "compact") {
      status("compacting…");
      const done = await api("POST", procPath(pid, "/compact"), {});
      const tokens = `${done.tokens_before} → ${done.tokens_after} tokens`;
      status(done.compacted ? `compacted: ${done.removed} older messages summarised (${tokens})` : done.note);
    } else if (what === "reset") {
      if (!confirm("Reset this process? Its history is archived and cleared.")) return;
      await api("POST", procPath(pid, "/reset"), {});
      await openProcess(view.pid);
      status("process reset");
    } else if (what === "kill") {
      if (!confirm("Kill this process? It cannot be used again.")) return;
      await api("DELETE", procPath(pid));
      view.close();
      view = null;
      sessionStorage.removeItem(PID_KEY);
      $("transcript").replaceChildren();
      $("approvals").replaceChildren();
      $("queue-list").replaceChildren();
      $("queue").hidden = true;
      showProcess(null);
      await listProcesses();
      status("process killed");
    }
  } catch (err) {
    status(`${what} failed: ${err.message}`);
  }
}

function wire() {
  $("signin-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const token = $("token").value.trim();
    $("token").value = "";
    signIn(token).catch((err) => signOut(`Sign-in failed: ${err.message}`));
  });
  $("signout").addEventListener("click", () => signOut());
  $("new-process").addEventListener("click", async () => {
    try {
      const process = await api("POST", "/v1/processes", {});
      await listProcesses();
      await openProcess(process.pid);
    } catch (err) {
      status(`could not start a process: ${err.message}`);
    }
  });
  $("compose").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("text").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
      event.preventDefault();
      send();
    }
  });
  for (const what of ["abort", "compact", "reset", "kill"]) $(what).addEventListener("click", () => act(what));
  $("fork").addEventListener("click", () => fork(undefined, ""));
  $("model-edit").addEventListener("click", () => ($("model-form").hidden ? openModelForm() : closeModelForm()));
  $("model-cancel").addEventListener("click", closeModelForm);
  $("model-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const spec = $("model-spec").value.trim();
    if (!spec) {
      $("model-error").textContent = "Name a model as provider:model, or reset to the default.";
      return;
    }
    setModel(spec, $("model-reasoning").value);
  });
  $("model-reset").addEventListener("click", () => setModel(null, ""));
  $("queue-clear").addEventListener("click", () => {
    if (view) view.withdraw();
  });
}

onUnauthorized(() => signOut("The token was refused; sign in again."));
wire();
const saved = tokenStore.get();
if (saved) signIn(saved).catch((err) => signOut(`Sign-in failed: ${err.message}`));
else signOut();
