// Overview: the fleet at a glance (admins, live from /console/api/live), or a non-admin key's
// own usage today.

import { api } from "./api.js";
import { onStatus, subscribe } from "./live.js";
import { sparkline, toast } from "./ui.js";
import { $, esc, ms, num, time } from "./util.js";

const HISTORY = 60;

export function render(main, { me, signal }) {
  return me.admin ? renderFleet(main, signal) : renderOwn(main, me, signal);
}

function renderFleet(main, signal) {
  main.innerHTML = `
    <h1>Overview</h1>
    <p class="status" aria-live="off">Live: <span id="live-status">connecting</span>
      · updated <span id="at">—</span></p>
    <section aria-labelledby="fleet-h">
      <h2 id="fleet-h" class="visually-hidden">Figures</h2>
      <div class="cards" id="cards"></div>
    </section>
    <section aria-labelledby="models-h">
      <h2 id="models-h">Models</h2>
      <div class="table-wrap"><table>
        <thead><tr><th scope="col">Model</th><th scope="col" class="n">Nodes</th>
          <th scope="col" class="n">Load / capacity</th><th scope="col" class="n">Queued</th><th scope="col" class="n">Running</th>
          <th scope="col" class="n">Requests</th><th scope="col" class="n">Failed</th>
          <th scope="col" class="n">Completion tokens</th><th scope="col" class="n">TTFT p50</th></tr></thead>
        <tbody id="models"></tbody>
      </table></div>
    </section>`;
  const history = { rps: [], tps: [] };
  const view = { overview: null, served: new Map() };
  const show = (o) => {
    history.rps = [...history.rps, o.requests_per_s].slice(-HISTORY);
    history.tps = [...history.tps, o.completion_tokens_per_s].slice(-HISTORY);
    view.overview = o;
    paint(main, view, history);
  };
  const showNodes = (json) => {
    view.served = served(json.nodes);
    if (view.overview) paint(main, view, history);
  };
  const failed = (err) => {
    if (err.name !== "AbortError") toast(err.message, "error");
  };
  api("/console/api/nodes", { signal }).then(showNodes, failed);
  api("/console/api/overview", { signal }).then(show, failed);
  const offStatus = onStatus((text) => {
    $(main, "#live-status").textContent = text;
  });
  const off = subscribe((event, json) => {
    if (event === "overview") show(json);
    else if (event === "nodes") showNodes(json);
  });
  return () => {
    off();
    offStatus();
  };
}

/** Every model some node serves: on how many nodes that can take runs, its load and capacity there. */
function served(nodes) {
  const models = new Map();
  for (const node of nodes) {
    for (const m of node.models) {
      const entry = models.get(m.id) ?? { nodes: 0, in_flight: 0, capacity: 0 };
      if (node.state === "ready") entry.nodes += 1;
      entry.in_flight += m.in_flight;
      entry.capacity += m.capacity;
      models.set(m.id, entry);
    }
  }
  return models;
}

function card(label, value, extra = "") {
  return `<div class="card figure"><h3>${esc(label)}</h3><p class="value">${esc(value)}</p>${extra}</div>`;
}

function paint(main, view, history) {
  const o = view.overview;
  const n = o.nodes;
  const traffic = new Map(o.models.map((m) => [m.id, m]));
  const ids = [...new Set([...view.served.keys(), ...traffic.keys()])].sort();
  $(main, "#at").textContent = `${time(o.at)} UTC (last ${num(o.window_seconds)} s)`;
  $(main, "#cards").innerHTML = [
    card("Nodes", `${num(n.total)}`,
      `<p class="states"><span class="pill ready">${num(n.ready)} ready</span>
       <span class="pill draining">${num(n.draining)} draining</span>
       <span class="pill unavailable">${num(n.unavailable)} unavailable</span></p>`),
    card("Models", num(ids.length), `<p class="sub">${esc(num(o.models.length))} with traffic</p>`),
    card("Requests/s", num(o.requests_per_s, 1), sparkline(history.rps, "requests per second, recent")),
    card("Tokens/s", num(o.completion_tokens_per_s, 1),
      `<p class="sub">prompt ${esc(num(o.prompt_tokens_per_s, 1))}/s</p>${sparkline(history.tps, "completion tokens per second, recent")}`),
    card("TTFT p50 / p95", `${ms(o.ttft_p50_ms)} / ${ms(o.ttft_p95_ms)}`),
    card("Queue", `${num(o.queued)} queued`, `<p class="sub">${esc(num(o.running))} running</p>`),
    card("Errors", num(o.failed), `<p class="sub">${esc(num(o.error_rate * 100, 2))}% of runs</p>`),
  ].join("");
  $(main, "#models").innerHTML = ids.length
    ? ids.map((id) => modelRow(id, view.served.get(id), traffic.get(id))).join("")
    : `<tr><td colspan="9">No models are served.</td></tr>`;
}

function modelRow(id, served, m = { queued: 0, running: 0, requests: 0, failed: 0, completion_tokens: 0, ttft_p50_ms: null }) {
  const nodes = served ? served.nodes : m.nodes;
  const load = served ? `${num(served.in_flight)} / ${num(served.capacity)}` : "—";
  return `<tr><th scope="row">${esc(id)}</th><td class="n">${num(nodes)}</td><td class="n">${load}</td>
    <td class="n">${num(m.queued)}</td><td class="n">${num(m.running)}</td>
    <td class="n">${num(m.requests)}</td><td class="n">${num(m.failed)}</td>
    <td class="n">${num(m.completion_tokens)}</td><td class="n">${ms(m.ttft_p50_ms)}</td></tr>`;
}

function renderOwn(main, me, signal) {
  main.innerHTML = `
    <h1>Overview</h1>
    <p>Your key <strong>${esc(me.key)}</strong> today (UTC). Live: <span id="live-status">connecting</span></p>
    <div class="cards" id="cards"></div>`;
  const show = (u) => {
    const t = u.totals;
    $(main, "#cards").innerHTML = [
      card("Requests", num(t.requests)),
      card("Prompt tokens", num(t.prompt_tokens)),
      card("Completion tokens", num(t.completion_tokens)),
      card("Cached tokens", num(t.cached_tokens)),
      card("Failed", num(t.failed)),
    ].join("");
  };
  const day = new Date();
  day.setUTCHours(0, 0, 0, 0);
  api(`/console/api/usage?bucket=day&start=${day.getTime() / 1000}`, { signal }).then(show, (err) => {
    if (err.name !== "AbortError") toast(err.message, "error");
  });
  const offStatus = onStatus((text) => {
    $(main, "#live-status").textContent = text;
  });
  const off = subscribe((event, json) => {
    if (event === "usage") show(json);
  });
  return () => {
    off();
    offStatus();
  };
}
