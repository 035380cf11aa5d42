// Playground: chat with a model through the OpenAI API itself (/v1/chat/completions,
// streamed, with usage). The page measures time to first token and tokens per second.

import { ApiError, api, events, request } from "./api.js";
import { toast } from "./ui.js";
import { $, esc, num } from "./util.js";

export function render(main, { signal }) {
  main.innerHTML = `
    <h1>Playground</h1>
    <div class="playground">
      <form id="settings" class="card settings">
        <h2>Settings</h2>
        <label for="p-model">Model</label><select id="p-model" name="model" required></select>
        <label for="p-system">System prompt</label><textarea id="p-system" name="system" rows="3"></textarea>
        <label for="p-temperature">Temperature</label><input id="p-temperature" name="temperature" type="number" min="0" max="2" step="0.1" value="0.7">
        <label for="p-top-p">Top p</label><input id="p-top-p" name="top_p" type="number" min="0" max="1" step="0.05" value="1">
        <label for="p-max">Max tokens</label><input id="p-max" name="max_tokens" type="number" min="1" step="1" value="256">
        <button type="button" id="clear">Clear chat</button>
      </form>
      <section class="chat" aria-labelledby="chat-h">
        <h2 id="chat-h" class="visually-hidden">Conversation</h2>
        <ol id="messages" class="messages" aria-live="polite"></ol>
        <p class="status" id="stats" aria-live="polite"></p>
        <p class="status" id="run" hidden>Run <span class="mono" id="run-id"></span></p>
        <form id="ask" class="ask">
          <label for="p-message">Message</label>
          <textarea id="p-message" name="message" rows="3" required></textarea>
          <div class="actions"><button type="submit" class="primary" id="send">Send</button>
            <button type="button" id="stop" disabled>Stop</button></div>
        </form>
      </section>
    </div>`;
  const chat = { history: [], controller: null };
  api("/v1/models", { signal }).then((json) => {
    const select = $(main, "#p-model");
    select.innerHTML = json.data.map((m) => `<option>${esc(m.id)}</option>`).join("")
      || `<option value="">no models</option>`;
  }, (err) => {
    if (err.name !== "AbortError") toast(err.message, "error");
  });
  $(main, "#ask").addEventListener("submit", (event) => {
    event.preventDefault();
    send(main, chat, signal);
  });
  $(main, "#p-message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $(main, "#ask").requestSubmit();
  });
  $(main, "#stop").addEventListener("click", () => chat.controller?.abort());
  $(main, "#clear").addEventListener("click", () => {
    chat.history = [];
    $(main, "#messages").innerHTML = "";
    $(main, "#stats").textContent = "";
    $(main, "#run").hidden = true;
  });
  return () => chat.controller?.abort();
}

function bubble(main, role, text) {
  const li = document.createElement("li");
  li.className = `message ${role}`;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = role === "user" ? "You" : "Model";
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  li.append(who, body);
  $(main, "#messages").append(li);
  return body;
}

function requestBody(main, chat) {
  const f = new FormData($(main, "#settings"));
  const messages = [];
  const system = f.get("system").trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...chat.history);
  const body = { model: f.get("model"), messages, stream: true, stream_options: { include_usage: true } };
  for (const [field, parse] of [["temperature", Number], ["top_p", Number], ["max_tokens", (v) => parseInt(v, 10)]]) {
    const v = f.get(field);
    if (v !== "") body[field] = parse(v);
  }
  return body;
}

async function send(main, chat, pageSignal) {
  const input = $(main, "#p-message");
  const text = input.value.trim();
  if (!text || chat.controller) return;
  input.value = "";
  bubble(main, "user", text);
  chat.history.push({ role: "user", content: text });
  const answer = bubble(main, "assistant", "");
  // Screen readers hold the live region's news while it is busy, then read the whole answer.
  const messages = $(main, "#messages");
  messages.setAttribute("aria-busy", "true");
  const controller = new AbortController();
  const leave = () => controller.abort(); // the page closed: stop the answer
  pageSignal.addEventListener("abort", leave);
  chat.controller = controller;
  $(main, "#send").disabled = true;
  $(main, "#stop").disabled = false;
  const stats = $(main, "#stats");
  stats.textContent = "Waiting for the first token…";
  $(main, "#run").hidden = true;
  const t0 = performance.now();
  let first = null;
  let usage = null;
  let finish = null;
  let streamed = 0; // chunks with text: the token count until the final usage tells it exactly
  try {
    const response = await request("/v1/chat/completions", { method: "POST", body: requestBody(main, chat), signal: controller.signal });
    showRun(main, response.headers.get("x-request-id"));
    for await (const { data } of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(500, chunk.error.message, chunk.error.code);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta?.content;
        if (delta) {
          if (first === null) first = performance.now();
          streamed += 1;
          answer.textContent += delta;
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
      stats.textContent = figures(t0, first, performance.now(), usage, streamed, null);
    }
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else {
      finish = "error";
      const p = document.createElement("p");
      p.className = "error";
      p.textContent = err.message;
      answer.append(p);
    }
  } finally {
    pageSignal.removeEventListener("abort", leave); // one listener per send, gone with it
    chat.controller = null;
    messages.removeAttribute("aria-busy");
    if (answer.textContent) chat.history.push({ role: "assistant", content: answer.firstChild?.nodeType === 3 ? answer.firstChild.data : "" });
    stats.textContent = figures(t0, first, performance.now(), usage, streamed, finish);
    if (!pageSignal.aborted) {
      $(main, "#send").disabled = false;
      $(main, "#stop").disabled = true;
      input.focus();
    }
  }
}

/** The run's id (the response's x-request-id), to find it in Runs. */
function showRun(main, id) {
  if (!id) return;
  $(main, "#run-id").textContent = id;
  $(main, "#run").hidden = false;
}

/**
 * "TTFT 42 ms · 18 tokens · 310.5 tokens/s · 12 prompt tokens · stop": while the answer streams,
 * its chunks counted as tokens ("≈"); the usage's exact figures once it came.
 */
function figures(t0, first, now, usage, streamed, finish) {
  if (first === null) return finish ? `No tokens (${finish}).` : "Waiting for the first token…";
  const about = usage ? "" : "≈";
  const tokens = usage ? usage.completion_tokens : streamed;
  const seconds = (now - first) / 1000;
  const parts = [`TTFT ${num(first - t0)} ms`, `${about}${num(tokens)} tokens`];
  if (seconds > 0) parts.push(`${about}${num(tokens / seconds, 1)} tokens/s`);
  if (usage) parts.push(`${num(usage.prompt_tokens)} prompt tokens`);
  if (finish) parts.push(finish);
  return parts.join(" · ");
}
