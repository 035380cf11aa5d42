// Runs: the ledger, newest first, filtered by model, status, caller, node and time (since,
// until), a page at a time (next_before). A run's details show its attempts as a timeline.

import { request } from "./api.js";
import { timeline, toast } from "./ui.js";
import { $, esc, fillRows, ms, num, parseUtc, prefill, query, time } from "./util.js";

const PAGE = 100;

export function render(main, { me, signal, params }) {
  main.innerHTML = `
    <h1>Runs</h1>
    <form class="filters" id="filter">
      <div><label for="r-model">Model</label><input id="r-model" name="model" spellcheck="false"></div>
      <div><label for="r-status">Status</label>
        <select id="r-status" name="status"><option value="">any</option><option>completed</option>
          <option>failed</option><option>cancelled</option></select></div>
      <div><label for="r-caller">Caller (key)</label><input id="r-caller" name="caller" spellcheck="false"
        ${me.admin ? "" : `value="${esc(me.key)}" readonly`}></div>
      <div><label for="r-node">Node</label><input id="r-node" name="node" spellcheck="false"></div>
      <div><label for="r-since">Since (UTC)</label><input id="r-since" name="since" type="datetime-local"></div>
      <div><label for="r-until">Until (UTC)</label><input id="r-until" name="until" type="datetime-local"></div>
      <div><label for="r-limit">Per page</label>
        <select id="r-limit" name="limit"><option>50</option><option selected>100</option>
          <option>200</option><option>500</option></select></div>
      <div class="submit"><button type="submit" class="primary">Show</button></div>
    </form>
    <p class="status" id="summary" aria-live="polite"></p>
    <div class="table-wrap"><table id="runs-table">
      <thead><tr><th scope="col">Received (UTC)</th><th scope="col">Run</th><th scope="col">Caller</th>
        <th scope="col">Model</th><th scope="col">Node</th><th scope="col">Status</th>
        <th scope="col" class="n">TTFT</th><th scope="col" class="n">Duration</th>
        <th scope="col" class="n">Prompt</th><th scope="col" class="n">Completion</th>
        <th scope="col" class="n">Attempts</th></tr></thead>
      <tbody id="rows"></tbody>
    </table></div>
    <nav class="pager" aria-label="Pages of runs">
      <button type="button" id="newer" disabled>Newer</button>
      <button type="button" id="older" disabled>Older</button>
    </nav>`;
  const state = { befores: [], next: null, runs: new Map() };
  const form = $(main, "#filter");
  prefill(form, params);
  const load = async (before) => {
    const f = new FormData(form);
    const params = {
      model: f.get("model").trim(), status: f.get("status"), caller: f.get("caller").trim(),
      node: f.get("node").trim(), since: parseUtc(f.get("since")), limit: f.get("limit") || PAGE,
      before: before ?? parseUtc(f.get("until")), // an older page starts below the last one, inside "until"
    };
    try {
      const response = await request(`/console/api/runs${query(params)}`, { signal });
      show(main, state, await response.json());
    } catch (err) {
      if (err.name !== "AbortError") toast(err.message, "error");
    }
  };
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    state.befores = [];
    load(null);
  });
  $(main, "#older").addEventListener("click", () => {
    state.befores.push(state.next);
    load(state.next);
  });
  $(main, "#newer").addEventListener("click", () => {
    state.befores.pop();
    load(state.befores[state.befores.length - 1] ?? null);
  });
  $(main, "#rows").addEventListener("click", (event) => {
    const button = event.target.closest("button[data-run]");
    if (button) toggleDetail(button, state.runs.get(button.dataset.run));
  });
  load(null);
}

function row(r) {
  const error = r.error ? ` title="${esc(`${r.error.code}: ${r.error.message}`)}"` : "";
  return `<tr><td>${time(r.received_at)}</td>
    <td><button type="button" class="link mono" aria-expanded="false" data-run="${esc(r.id)}">${esc(r.id)}</button></td>
    <td>${esc(r.caller)}</td><td>${esc(r.model)}</td><td>${esc(r.node)}</td>
    <td><span class="pill ${esc(r.status)}"${error}>${esc(r.status)}</span></td>
    <td class="n">${ms(r.ttft_ms)}</td><td class="n">${ms(r.duration_ms)}</td>
    <td class="n">${num(r.prompt_tokens)}</td><td class="n">${num(r.completion_tokens)}${r.estimated ? "*" : ""}</td>
    <td class="n">${num(r.attempts.length)}</td></tr>`;
}

function show(main, state, page) {
  state.next = page.next_before;
  state.runs = new Map(page.runs.map((r) => [r.id, r]));
  fillRows($(main, "#rows"), page.runs.map(row), "runs", `<tr><td colspan="11">No runs match.</td></tr>`);
  const pageNo = state.befores.length + 1;
  $(main, "#summary").textContent = `Page ${pageNo}: ${num(page.runs.length)} runs${page.more ? ", more older" : ""}. * estimated token count.`;
  $(main, "#older").disabled = !page.more || page.next_before === null;
  $(main, "#newer").disabled = state.befores.length === 0;
}

/** Open (or close) a run's details in a row right below it. */
function toggleDetail(button, r) {
  const tr = button.closest("tr");
  const open = tr.nextElementSibling?.classList.contains("detail");
  if (open) tr.nextElementSibling.remove();
  button.setAttribute("aria-expanded", String(!open));
  if (open || !r) return;
  const detail = document.createElement("tr");
  detail.className = "detail";
  detail.innerHTML = `<td colspan="11">${detailHtml(r)}</td>`;
  tr.after(detail);
}

function detailHtml(r) {
  const error = r.error ? `<dt>Error</dt><dd>${esc(r.error.code)}: ${esc(r.error.message)}</dd>` : "";
  return `
    <dl class="facts">
      <dt>Run</dt><dd class="mono">${esc(r.id)}</dd>
      <dt>Status</dt><dd>${esc(r.status)}${r.finish_reason ? ` (${esc(r.finish_reason)})` : ""}</dd>${error}
      <dt>Tokens</dt><dd>${num(r.prompt_tokens)} prompt (${num(r.cached_tokens)} cached), ${num(r.completion_tokens)} completion${r.estimated ? " (estimated)" : ""}</dd>
      <dt>Outputs</dt><dd>${num(r.outputs)}, ${num(r.migrations)} migrations</dd>
    </dl>
    <h2 class="small">Attempts</h2>
    ${r.attempts.length ? timeline(r.attempts, r.duration_ms) : "<p>No attempt reached a node.</p>"}
    <table class="inner">
      <thead><tr><th scope="col">Node</th><th scope="col">Model</th><th scope="col">Outcome</th>
        <th scope="col">Reason</th><th scope="col" class="n">Start</th><th scope="col" class="n">Duration</th>
        <th scope="col" class="n">Outputs</th></tr></thead>
      <tbody>${r.attempts.map((a) => `<tr><td>${esc(a.node)}</td><td>${esc(a.model)}</td><td>${esc(a.outcome)}</td>
        <td>${esc(a.reason || "")}</td><td class="n">${ms(a.started_ms)}</td><td class="n">${ms(a.duration_ms)}</td>
        <td class="n">${num(a.outputs)}</td></tr>`).join("")}</tbody>
    </table>`;
}
