// Nodes: every node the control-plane knows, live. Rows are built as one string of escaped
// text; live updates rewrite only the rows whose data changed; one click listener on the
// table serves every row's buttons (drain, undrain, remove; admins only, with a confirm).

import { api } from "./api.js";
import { onStatus, subscribe } from "./live.js";
import { busy, confirmAction, toast } from "./ui.js";
import { $, esc, fillRows, num, time } from "./util.js";

const ACTIONS = {
  drain: { label: "Drain", ask: (id) => `Drain node ${id}? It takes no new runs; running ones finish.` },
  undrain: { label: "Undrain", ask: (id) => `Undrain node ${id}? It takes new runs again.` },
  remove: { label: "Remove", ask: (id) => `Remove node ${id}? Its certificate is revoked at once and its runs move elsewhere.` },
};

export function render(main, { me, signal }) {
  main.innerHTML = `
    <h1>Nodes</h1>
    <p class="status">Live: <span id="live-status">connecting</span> · <span id="count">—</span></p>
    <form class="filters" id="filter">
      <div><label for="f-text">Filter by id, model or address</label>
        <input id="f-text" type="search" spellcheck="false"></div>
      <div><label for="f-state">State</label>
        <select id="f-state"><option value="">any</option><option>ready</option>
          <option>draining</option><option>unavailable</option></select></div>
    </form>
    <div class="table-wrap"><table id="nodes-table">
      <thead><tr><th scope="col">Node</th><th scope="col">State</th><th scope="col">Models</th>
        <th scope="col" class="n">Load / capacity</th><th scope="col" class="n">Heartbeat</th>
        <th scope="col">Address</th>${me.admin ? `<th scope="col">Actions</th>` : ""}</tr></thead>
      <tbody id="rows"><tr><td colspan="7">Loading…</td></tr></tbody>
    </table></div>`;
  const view = { nodes: [], shown: [], signatures: new Map(), admin: me.admin };
  const filter = $(main, "#filter");
  const refilter = () => paint(main, view, true);
  filter.addEventListener("input", refilter);
  filter.addEventListener("submit", (e) => e.preventDefault());
  $(main, "#rows").addEventListener("click", (event) => act(event, main, view, signal));
  const show = (json) => {
    view.nodes = json.nodes;
    paint(main, view, false);
  };
  const load = () => api("/console/api/nodes", { signal }).then(show, (err) => {
    if (err.name !== "AbortError") toast(err.message, "error");
  });
  view.reload = load;
  load();
  const offStatus = onStatus((text) => {
    $(main, "#live-status").textContent = text;
  });
  const off = subscribe((event, json) => {
    if (event === "nodes") show(json);
  });
  return () => {
    off();
    offStatus();
  };
}

function matches(node, text, state) {
  if (state && node.state !== state) return false;
  if (!text) return true;
  if (node.id.toLowerCase().includes(text) || (node.address || "").toLowerCase().includes(text)) return true;
  return node.models.some((m) => m.id.toLowerCase().includes(text));
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "never";
  return seconds < 60 ? `${num(seconds)} s ago` : `${num(seconds / 60, 1)} min ago`;
}

const HEARTBEAT_CELL = 4;

/** What a row shows apart from the heartbeat's age (which changes on every update). */
function signature(node) {
  return JSON.stringify({ ...node, heartbeat_age_s: undefined });
}

function cells(node, admin) {
  const models = node.models.map((m) => `${esc(m.id)} <span class="muted">${num(m.in_flight)}/${num(m.capacity)}</span>`).join("<br>");
  const reason = node.reason ? `<br><span class="muted">${esc(node.reason)}</span>` : "";
  let actions = "";
  if (admin) {
    const id = esc(node.id);
    const drain = node.state === "draining" ? "undrain" : "drain";
    actions = `<td class="actions"><button type="button" data-action="${drain}" data-node="${id}">${ACTIONS[drain].label}</button>
      <button type="button" class="danger" data-action="remove" data-node="${id}">Remove</button></td>`;
  }
  return `<th scope="row" title="first seen ${esc(time(node.first_seen))} UTC">${esc(node.id)}</th>
    <td><span class="pill ${esc(node.state)}">${esc(node.state)}</span>${reason}</td>
    <td>${models || `<span class="muted">none</span>`}</td>
    <td class="n">${num(node.in_flight)} / ${num(node.capacity)}</td>
    <td class="n">${age(node.heartbeat_age_s)}</td>
    <td>${esc(node.address || "")}</td>${actions}`;
}

/** Re-render all rows when the set or order changed, else only the changed rows and cells. */
function paint(main, view, full) {
  const text = $(main, "#f-text").value.trim().toLowerCase();
  const state = $(main, "#f-state").value;
  const shown = view.nodes.filter((n) => matches(n, text, state));
  const tbody = $(main, "#rows");
  const sameSet = !full && shown.length === view.shown.length
    && shown.every((n, i) => n.id === view.shown[i].id);
  const ready = view.nodes.filter((n) => n.state === "ready").length;
  $(main, "#count").textContent = `${num(view.nodes.length)} nodes, ${num(ready)} ready, ${num(shown.length)} shown`;
  if (sameSet && tbody.rows.length <= shown.length) {
    // The same nodes in the same order: rewrite what changed in the rows already in the table
    // (rows still being added by fillRows come from the previous data; the next update fixes them).
    shown.slice(0, tbody.rows.length).forEach((node, i) => {
      const row = tbody.rows[i];
      const sig = signature(node);
      if (view.signatures.get(node.id) !== sig) {
        // Keep focus on a row's button across its update (keyboard users mid-table).
        const focused = row.contains(document.activeElement) ? document.activeElement.dataset.action : null;
        row.innerHTML = cells(node, view.admin);
        view.signatures.set(node.id, sig);
        if (focused) (row.querySelector(`[data-action="${focused}"]`) ?? row.querySelector("button"))?.focus();
        return;
      }
      const cell = row.cells[HEARTBEAT_CELL];
      const text = age(node.heartbeat_age_s);
      if (cell.textContent !== text) cell.textContent = text;
    });
  } else {
    view.signatures = new Map(shown.map((n) => [n.id, signature(n)]));
    const empty = `<tr><td colspan="7">No nodes${view.nodes.length ? " match the filter" : ""}.</td></tr>`;
    fillRows(tbody, shown.map((n) => `<tr>${cells(n, view.admin)}</tr>`), "nodes", empty);
  }
  view.shown = shown;
}

async function act(event, main, view, signal) {
  const button = event.target.closest("button[data-action]");
  if (!button) return;
  const { action, node } = button.dataset;
  if (!(await confirmAction(ACTIONS[action].ask(node), ACTIONS[action].label))) {
    button.focus();
    return;
  }
  await busy(button, async () => {
    const res = await api(`/console/api/nodes/${encodeURIComponent(node)}/${action}`, { method: "POST", body: {}, signal });
    toast(res.message);
    await view.reload();
  });
  if (button.isConnected) button.focus();
}
