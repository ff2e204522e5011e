// The /v1 API over fetch, with the bearer token; and its event stream as server-sent events.

const TOKEN_KEY = "agentloop.token";
// The token lives in sessionStorage: it survives a reload of this tab (so the stream can resume)
// but not the tab itself, is not shared with other tabs, and is never written to disk the way
// localStorage is. It is sent only as an Authorization header, never in a URL, because URLs end
// up in server logs, proxy logs and browser history.
export const tokenStore = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (token) => sessionStorage.setItem(TOKEN_KEY, token),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};


let unauthorized = () => {};

/** What to do when the server refuses the token (the page signs out). */
export function onUnauthorized(handler) {
  unauthorized = handler;
}

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message || code || `HTTP ${status}`);
    this.status = status;
    this.code = code;
  }
}

/** The path of a process's resource: `/v1/processes/<pid><rest>`, the pid escaped. */
export function procPath(pid, rest = "") {
  return `/v1/processes/${encodeURIComponent(pid)}${rest}`;
}

function authHeaders() {
  return { Authorization: `Bearer ${tokenStore.get()}` };
}

/** The ApiError of a refused request (a refused token signs the page out first). */
async function refusal(resp) {
  const data = await resp.json().catch(() => null);
  if (resp.status === 401) unauthorized();
  return new ApiError(resp.status, data?.code, data?.message);
}

export async function api(method, path, body) {
  const headers = authHeaders();
  const init = { method, headers, cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(path, init);
  if (!resp.ok) throw await refusal(resp);
  return resp.json().catch(() => null);
}

/** Server-sent events over fetch (EventSource cannot send an Authorization header). Yields
 * {event, id, data} until the server ends the stream; throws ApiError on a refusal. */
export async function* sse(path, lastEventId, signal, onOpen) {
  const headers = { ...authHeaders(), Accept: "text/event-stream" };
  if (lastEventId !== null) headers["Last-Event-ID"] = String(lastEventId);
  const resp = await fetch(path, { headers, signal, cache: "no-store" });
  if (!resp.ok) throw await refusal(resp);
  if (onOpen) onOpen();
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let frame = { data: [] };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    // A line ends at \r\n, \n or \r; a \r at the very end may be half of a \r\n still to come.
    for (let m = /\r\n|\r(?!$)|\n/.exec(buffer); m; m = /\r\n|\r(?!$)|\n/.exec(buffer)) {
      const line = buffer.slice(0, m.index);
      buffer = buffer.slice(m.index + m[0].length);
      if (line === "") {
        if (frame.data.length) yield { event: frame.event, id: frame.id, data: frame.data.join("\n") };
        frame = { data: [] };
      } else if (!line.startsWith(":")) {
        const colon = line.indexOf(":");
        const name = colon < 0 ? line : line.slice(0, colon);
        let field = colon < 0 ? "" : line.slice(colon + 1);
        if (field.startsWith(" ")) field = field.slice(1);
        if (name === "data") frame.data.push(field);
        else if (name === "event" || name === "id") frame[name] = field;
      }
    }
  }
}
