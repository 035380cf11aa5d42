// Batches: OpenAI batch objects (an admin sees every caller's) with progress, cancel, and
// the output and error files fetched with the key. Refreshed every few seconds while the tab is
// visible and a batch on the page is still in progress (no polling for a hidden or settled page).

import { api, request } from "./api.js";
import { busy, confirmAction, focusRow, repaintKeepingFocus, toast } from "./ui.js";
import { $, esc, num, query, saveBlob, time } from "./util.js";

const REFRESH_MS = 3000;
const CANCELLABLE = new Set(["validating", "in_progress", "finalizing"]);
const IN_PROGRESS = new Set([...CANCELLABLE, "cancelling"]);

export function render(main, { signal }) {
  main.innerHTML = `
    <h1>Batches</h1>
    <p class="status" id="summary"></p>
    <div class="table-wrap"><table id="batches-table">
      <thead><tr><th scope="col">Batch</th><th scope="col">Owner</th><th scope="col">Status</th>
        <th scope="col">Progress</th><th scope="col">Created (UTC)</th><th scope="col">Endpoint</th>
        <th scope="col">Actions</th></tr></thead>
      <tbody id="rows"></tbody>
    </table></div>
    <nav class="pager" aria-label="Pages of batches">
      <button type="button" id="first" disabled>First page</button>
      <button type="button" id="more" disabled>Next page</button>
    </nav>`;
  const view = { after: null, last: null, timer: null, moving: false };
  const load = async () => {
    clearTimeout(view.timer);
    view.timer = null;
    try {
      const page = await api(`/console/api/batches${query({ after: view.after, limit: 50 })}`, { signal });
      paint(main, page);
      view.last = page.data.length ? page.data[page.data.length - 1].id : null;
      view.moving = page.data.some((b) => IN_PROGRESS.has(b.status));
      $(main, "#more").disabled = !page.has_more;
      $(main, "#first").disabled = view.after === null;
    } catch (err) {
      if (err.name === "AbortError") return;
      toast(err.message, "error");
    }
    // Again in a few seconds only while something can change and someone can see it.
    if (view.moving && document.visibilityState === "visible" && !signal.aborted) {
      view.timer = setTimeout(load, REFRESH_MS);
    }
  };
  const shown = () => {
    if (document.visibilityState === "visible" && view.timer === null) load();
  };
  document.addEventListener("visibilitychange", shown);
  $(main, "#more").addEventListener("click", () => {
    view.after = view.last;
    load();
  });
  $(main, "#first").addEventListener("click", () => {
    view.after = null;
    load();
  });
  $(main, "#rows").addEventListener("click", (event) => act(event, load, signal));
  load();
  return () => {
    clearTimeout(view.timer);
    document.removeEventListener("visibilitychange", shown);
  };
}

function progress(b) {
  const c = b.request_counts || { total: 0, completed: 0, failed: 0 };
  const done = c.completed + c.failed;
  const label = `${num(c.completed)} done, ${num(c.failed)} failed of ${num(c.total)}`;
  return `<progress max="${Math.max(c.total, 1)}" value="${done}" aria-label="${esc(label)}"></progress>
    <span class="muted">${esc(label)}</span>`;
}

let painted = "";

function paint(main, page) {
  // The list refreshes every few seconds: leave the rows alone when unchanged, and keep the
  // keyboard focus on its row when they change.
  const signature = JSON.stringify(page.data);
  if (signature === painted && main.querySelector("#rows").rows.length) return;
  painted = signature;
  repaintKeepingFocus($(main, "#rows"), page.data.length
    ? page.data.map((b) => {
      const id = esc(b.id);
      const buttons = [
        CANCELLABLE.has(b.status) ? `<button type="button" class="danger" data-cancel="${id}">Cancel</button>` : "",
        b.output_file_id ? `<button type="button" data-file="${esc(b.output_file_id)}" data-name="${id}-output.jsonl">Output</button>` : "",
        b.error_file_id ? `<button type="button" data-file="${esc(b.error_file_id)}" data-name="${id}-errors.jsonl">Errors</button>` : "",
      ].join(" ");
      return `<tr data-row="${id}"><th scope="row" class="mono">${id}</th><td>${esc(b.owner ?? "—")}</td>
        <td><span class="pill ${esc(b.status)}">${esc(b.status)}</span></td><td>${progress(b)}</td>
        <td>${time(b.created_at)}</td><td>${esc(b.endpoint)}</td><td class="actions">${buttons}</td></tr>`;
    }).join("")
    : `<tr><td colspan="7">No batches.</td></tr>`);
  $(main, "#summary").textContent = `${num(page.data.length)} batches on this page; refreshed every ${REFRESH_MS / 1000} s while one is in progress.`;
}

async function act(event, load, signal) {
  const rows = event.currentTarget;
  const cancel = event.target.closest("button[data-cancel]");
  const file = event.target.closest("button[data-file]");
  if (cancel) {
    const id = cancel.dataset.cancel;
    if (!(await confirmAction(`Cancel batch ${id}? Lines not yet run are not run.`, "Cancel batch", "Keep it"))) return;
    await busy(cancel, async () => {
      const b = await api(`/console/api/batches/${encodeURIComponent(id)}/cancel`, { method: "POST", signal });
      toast(`Batch ${b.id} ${b.status}`);
      await load();
    });
    // Its button is gone with the repaint: the keyboard focus stays on the batch's row.
    if (!cancel.isConnected) focusRow(rows, id);
  } else if (file) {
    await busy(file, async () => {
      const response = await request(`/console/api/files/${encodeURIComponent(file.dataset.file)}/content`, { signal });
      saveBlob(await response.blob(), file.dataset.name);
    });
  }
}
