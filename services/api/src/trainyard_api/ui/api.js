// The API as the pages use it: the token from sessionStorage on every request, errors as ApiError with the
// API's own message, and the server-sent events stream read with fetch (EventSource cannot send a header).

const KEY = "trainyard.token";

export const session = {
  token: () => sessionStorage.getItem(KEY),
  signIn: (token) => sessionStorage.setItem(KEY, token),
  signOut: () => sessionStorage.removeItem(KEY),
};

export class ApiError extends Error {
  constructor(status, detail) {
    super(typeof detail === "string" ? detail : describeProblems(detail));
    this.status = status;
    this.detail = detail;
  }
}

function describeProblems(detail) {
  if (Array.isArray(detail)) return detail.map((p) => (p.field ? `${p.field}: ${p.message}` : p.message || JSON.stringify(p))).join("; ");
  return detail == null ? "request failed" : JSON.stringify(detail);
}

function headers(extra = {}) {
  const h = { ...extra };
  const token = session.token();
  if (token) h.Authorization = `Bearer ${token}`;
  return h;
}

async function failure(response) {
  let detail = response.statusText || `HTTP ${response.status}`;
  try {
    const body = await response.json();
    if (body && body.detail !== undefined) detail = body.detail;
  } catch { /* not JSON: keep the status text */ }
  return new ApiError(response.status, detail);
}

/** GET (or `method`) `path`; the JSON answer, or the text with `{text: true}`. */
export async function api(path, { method = "GET", body, text = false, signal } = {}) {
  const init = { method, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }), signal };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  if (!response.ok) throw await failure(response);
  return text ? response.text() : response.json();
}

/** Read a streamed text response chunk by chunk (`onText(chunk)`), until it ends or `signal` aborts. */
export async function stream(path, onText, signal) {
  const response = await fetch(path, { headers: headers(), signal });
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    onText(value);
  }
}

/** Parse server-sent events out of text chunks: calls `onEvent(name, data)` for each complete event. */
export function sseParser(onEvent) {
  let buffer = "";
  return (chunk) => {
    buffer += chunk.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) continue; // keepalive comment
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") name = value;
        else if (field === "data") data.push(value);
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  };
}

/** The API no longer takes this tab's token (a `closed` event, or a 401): the shell shows the sign-in form. */
export function tokenRefused(reason) {
  window.dispatchEvent(new CustomEvent("trainyard:token-refused", { detail: reason }));
}

/**
 * Follow `GET /v1/events` (optionally one job's): `onJob(summary)` for each `job` event. Reconnects after a
 * dropped stream; where the server has no event stream, falls back to `poll()` every few seconds. A `closed`
 * event (the token was revoked or expired) or a 401 ends it and signs the tab out with the reason.
 */
export function liveJobs({ jobId, onJob, poll, signal }) {
  const path = "/v1/events" + (jobId ? `?jobId=${encodeURIComponent(jobId)}` : "");
  let refused = null;
  const parse = sseParser((name, data) => {
    if (name === "closed") {
      try { refused = JSON.parse(data).reason; } catch { refused = "the API closed the stream"; }
      return;
    }
    if (name === "resync" && poll) { poll().catch(() => {}); return; } // the server dropped events for us: re-read
    if (name !== "job") return;
    try { onJob(JSON.parse(data)); } catch (e) { console.warn("unreadable job event", e); }
  });
  const wait = (ms) => new Promise((resolve) => { const t = setTimeout(resolve, ms); signal.addEventListener("abort", () => { clearTimeout(t); resolve(); }, { once: true }); });
  (async () => {
    let streaming = true;
    while (!signal.aborted) {
      if (streaming) {
        try {
          await stream(path, parse, signal);
        } catch (e) {
          if (signal.aborted) return;
          if (e instanceof ApiError && e.status === 401) refused = e.message;
          else if (e instanceof ApiError && (e.status === 404 || e.status === 405)) streaming = false;
          else console.warn("event stream dropped, reconnecting:", e.message);
        }
        if (refused !== null) return tokenRefused(refused);
        if (poll && !signal.aborted) await poll().catch(() => {}); // catch up on what the gap missed
        await wait(2000);
      } else {
        await poll().catch(() => {});
        await wait(3000);
      }
    }
  })();
}
