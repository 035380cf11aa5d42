// The console's only way to the server: every call carries the API key kept in sessionStorage
// (the page holds no data of its own). Errors become ApiError with the server's message.

const STORE = "iop.console.key";

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function savedKey() {
  return sessionStorage.getItem(STORE);
}

export function saveKey(key) {
  sessionStorage.setItem(STORE, key);
}

export function forgetKey() {
  sessionStorage.removeItem(STORE);
}

/** Listeners told when the server refuses the key (401): the app signs out. */
const unauthorized = new Set();
export function onUnauthorized(fn) {
  unauthorized.add(fn);
}

function headers(extra = {}, key = savedKey()) {
  const h = { ...extra };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

/** Turn a refused response into an ApiError (OpenAI-style error JSON when there is one). */
async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch {
    // Not JSON (a proxy's page, say): keep the status line.
  }
  if (response.status === 401) for (const fn of unauthorized) fn(message);
  return new ApiError(response.status, message, code);
}

/** fetch() with the key; throws ApiError unless 2xx. Returns the Response. */
export async function request(path, { method = "GET", body, signal, key } = {}) {
  const init = { method, signal, headers: headers({}, key ?? savedKey()) };
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, "the server cannot be reached", "network");
  }
  if (!response.ok) throw await failure(response);
  return response;
}

/** A JSON API call. */
export async function api(path, options = {}) {
  const response = await request(path, options);
  return response.json();
}

/**
 * Read a text/event-stream body, yielding {event, data} per event (data lines joined).
 * Works for the console's live stream and OpenAI's chat chunks alike.
 */
export async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const parsed = parseEvent(block);
        if (parsed) yield parsed;
      }
    }
  } finally {
    reader.releaseLock();
  }
}

function parseEvent(block) {
  let event = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  return data.length ? { event, data: data.join("\n") } : null;
}
