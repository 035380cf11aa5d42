// Keys (admins): create a key with its limits (the secret is shown once, with a copy
// button), list keys, revoke one after a confirm.

import { api } from "./api.js";
import { busy, confirmAction, focusRow, repaintKeepingFocus, toast } from "./ui.js";
import { $, esc, num, time } from "./util.js";

export function render(main, { signal }) {
  main.innerHTML = `
    <h1>Keys</h1>
    <section class="card" aria-labelledby="create-h">
      <h2 id="create-h">Create a key</h2>
      <form class="filters" id="create">
        <div><label for="k-name">Name</label><input id="k-name" name="name" required spellcheck="false" autocomplete="off"></div>
        <div><label for="k-rpm">Requests per minute</label><input id="k-rpm" name="rpm" type="number" min="1" step="1" placeholder="no limit"></div>
        <div><label for="k-tpm">Tokens per minute</label><input id="k-tpm" name="tpm" type="number" min="1" step="1" placeholder="no limit"></div>
        <div><label for="k-conc">Max concurrent</label><input id="k-conc" name="max_concurrent" type="number" min="1" step="1" placeholder="no limit"></div>
        <div class="check"><input id="k-admin" name="admin" type="checkbox"><label for="k-admin">Admin</label></div>
        <div class="submit"><button type="submit" class="primary">Create</button></div>
      </form>
      <div id="secret" hidden></div>
    </section>
    <section aria-labelledby="list-h">
      <h2 id="list-h">Keys</h2>
      <div class="table-wrap"><table id="keys-table">
        <thead><tr><th scope="col">Name</th><th scope="col">Key id</th><th scope="col">Admin</th>
          <th scope="col">Created (UTC)</th><th scope="col">Status</th><th scope="col" class="n">rpm</th>
          <th scope="col" class="n">tpm</th><th scope="col" class="n">Concurrent</th><th scope="col">Actions</th></tr></thead>
        <tbody id="rows"></tbody>
      </table></div>
    </section>`;
  const load = () => api("/console/api/keys", { signal }).then((json) => paint(main, json.keys), (err) => {
    if (err.name !== "AbortError") toast(err.message, "error");
  });
  const form = $(main, "#create");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    busy(form.querySelector("button[type=submit]"), async () => {
      const created = await api("/console/api/keys", { method: "POST", body: body(form), signal });
      showSecret(main, created);
      form.reset();
      await load();
    });
  });
  $(main, "#secret").addEventListener("click", (event) => {
    if (event.target.id === "copy") copy(main);
  });
  $(main, "#rows").addEventListener("click", async (event) => {
    const button = event.target.closest("button[data-revoke]");
    if (!button) return;
    const name = button.dataset.revoke;
    if (!(await confirmAction(`Revoke key ${name}? Calls with it fail from now on.`, "Revoke"))) {
      button.focus();
      return;
    }
    await busy(button, async () => {
      await api(`/console/api/keys/${encodeURIComponent(name)}`, { method: "DELETE", signal });
      toast(`Key ${name} revoked`);
      await load();
    });
    // Its button is gone with the repaint: the keyboard focus stays on the key's row.
    if (!button.isConnected) focusRow($(main, "#rows"), name);
  });
  load();
}

function body(form) {
  const f = new FormData(form);
  const out = { name: f.get("name").trim(), admin: f.get("admin") === "on" };
  for (const field of ["rpm", "tpm", "max_concurrent"]) {
    const v = f.get(field);
    if (v !== "") out[field] = Number(v);
  }
  return out;
}

function showSecret(main, created) {
  const box = $(main, "#secret");
  box.hidden = false;
  box.className = "secret";
  box.innerHTML = `
    <p role="status">Key <strong>${esc(created.name)}</strong> created. Copy its secret now: it is not shown again.</p>
    <label for="secret-value">Secret</label>
    <div class="row"><input id="secret-value" readonly value="${esc(created.key)}" class="mono">
      <button type="button" id="copy">Copy</button></div>`;
  $(box, "#secret-value").select();
  $(box, "#copy").focus();
}

async function copy(main) {
  const input = $(main, "#secret-value");
  try {
    await navigator.clipboard.writeText(input.value);
  } catch {
    // No clipboard permission (plain http on another host): fall back to the selection.
    input.select();
    document.execCommand("copy");
  }
  toast("Secret copied");
}

function paint(main, keys) {
  repaintKeepingFocus($(main, "#rows"), keys.length
    ? keys.map((k) => `<tr data-row="${esc(k.name)}"${k.revoked_at ? ` class="revoked"` : ""}><th scope="row">${esc(k.name)}</th>
        <td class="mono">${esc(k.key_id)}</td><td>${k.admin ? "yes" : "no"}</td><td>${time(k.created_at)}</td>
        <td>${k.revoked_at ? `revoked ${time(k.revoked_at)}` : "active"}</td>
        <td class="n">${num(k.rpm)}</td><td class="n">${num(k.tpm)}</td><td class="n">${num(k.max_concurrent)}</td>
        <td>${k.revoked_at ? "" : `<button type="button" class="danger" data-revoke="${esc(k.name)}">Revoke</button>`}</td></tr>`).join("")
    : `<tr><td colspan="9">No keys.</td></tr>`);
}
