// One shared reader of /console/api/live for the pages open in this tab. The stream is read
// with fetch() (EventSource cannot send the Authorization header); when it ends or fails the
// reader waits and reconnects, the wait doubling from 1 s to 30 s and reset by a good event; after
// a `reconnect` event (the edge renews every stream every ten minutes) it reconnects at once.

import { ApiError, events, request } from "./api.js";

const MIN_WAIT_MS = 1000;
const MAX_WAIT_MS = 30000;

const subscribers = new Set();
let controller = null;

/** Status listeners see "live", "connecting" or "retrying in N s (reason)". */
const statusListeners = new Set();
let status = "connecting";

function setStatus(text) {
  status = text;
  for (const fn of statusListeners) fn(text);
}

export function onStatus(fn) {
  statusListeners.add(fn);
  fn(status);
  return () => statusListeners.delete(fn);
}

/** Call handler(event, json) for every live event until the returned function is called. */
export function subscribe(handler) {
  subscribers.add(handler);
  if (!controller) start();
  return () => {
    subscribers.delete(handler);
    if (subscribers.size === 0 && controller) {
      controller.abort();
      controller = null;
    }
  };
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => {
      clearTimeout(timer);
      resolve();
    });
  });
}

async function start() {
  controller = new AbortController();
  const { signal } = controller;
  let wait = MIN_WAIT_MS;
  while (!signal.aborted) {
    let reason = "stream ended";
    let renew = false;
    try {
      setStatus("connecting");
      const response = await request("/console/api/live", { signal });
      for await (const { event, data } of events(response)) {
        wait = MIN_WAIT_MS;
        setStatus("live");
        if (event === "reconnect") {
          renew = true; // the edge ends every stream after a while: open the next one at once
          continue;
        }
        const json = JSON.parse(data);
        for (const fn of subscribers) fn(event, json);
      }
    } catch (err) {
      if (signal.aborted) return;
      if (err instanceof ApiError && err.status === 401) return;
      reason = err.message;
    }
    if (signal.aborted) return;
    if (renew) continue;
    setStatus(`retrying in ${Math.round(wait / 1000)} s (${reason})`);
    await sleep(wait, signal);
    wait = Math.min(wait * 2, MAX_WAIT_MS);
  }
}

/** Stop the stream (sign-out). */
export function stopLive() {
  subscribers.clear();
  if (controller) controller.abort();
  controller = null;
}
