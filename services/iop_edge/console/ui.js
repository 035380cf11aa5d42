// Shared pieces of the page: toasts (announced by the aria-live region), the confirm dialog
// (a native <dialog>: focus stays inside it and Escape closes it) and hand-written SVG charts.

import { esc, num } from "./util.js";

/** Show a short message for a few seconds; kind "error" stays until closed. */
export function toast(message, kind = "info") {
  const region = document.getElementById("toasts");
  const item = document.createElement("div");
  item.className = `toast ${kind}`;
  item.textContent = message;
  const close = document.createElement("button");
  close.type = "button";
  close.className = "link";
  close.textContent = "Dismiss";
  close.addEventListener("click", () => item.remove());
  item.append(" ", close);
  region.append(item);
  if (kind !== "error") setTimeout(() => item.remove(), 5000);
}

/** Ask before an action; resolves true when the user confirms. */
export function confirmAction(message, confirmLabel = "Confirm", dismissLabel = "Cancel") {
  const dialog = document.getElementById("confirm");
  dialog.querySelector("#confirm-text").textContent = message;
  dialog.querySelector("#confirm-ok").textContent = confirmLabel;
  dialog.querySelector("#confirm-cancel").textContent = dismissLabel;
  dialog.returnValue = "";
  dialog.showModal();
  dialog.querySelector("#confirm-cancel").focus();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
  });
}

/** Run an async action from a button: disabled while it runs, errors toasted. */
export async function busy(button, action) {
  const focused = document.activeElement === button;
  button.disabled = true;
  try {
    return await action();
  } catch (err) {
    if (err.name !== "AbortError") toast(err.message, "error");
    return undefined;
  } finally {
    button.disabled = false;
    // A disabled button drops the focus to <body>: give it back (keyboard users stay in place).
    if (focused && button.isConnected && document.activeElement === document.body) button.focus();
  }
}

/**
 * Repaint a table body keeping the keyboard focus: on the same button of the same row
 * (rows carry data-row, buttons a data-* naming their action) or, when that button is gone,
 * on the row's header cell.
 */
export function repaintKeepingFocus(tbody, html) {
  const active = document.activeElement;
  const row = tbody.contains(active) ? active.closest("tr[data-row]")?.dataset.row : undefined;
  const action = row === undefined ? null : [...active.attributes].find((a) => a.name.startsWith("data-"));
  tbody.innerHTML = html;
  if (row !== undefined) focusRow(tbody, row, action);
}

/** Focus a row's button (the attribute `action` of one before a repaint) or its header cell. */
export function focusRow(tbody, row, action = null) {
  const tr = [...tbody.querySelectorAll("tr[data-row]")].find((r) => r.dataset.row === row);
  if (!tr) return;
  const same = action ? [...tr.querySelectorAll(`[${action.name}]`)].find((e) => e.getAttribute(action.name) === action.value) : null;
  const target = same ?? tr.querySelector("th, td");
  if (!same) target.tabIndex = -1;
  target.focus();
}

const W = 800;
const H = 220;
const PAD = { left: 56, right: 8, top: 10, bottom: 28 };

function ticks(max) {
  if (max <= 0) return [0, 1];
  const step = 10 ** Math.floor(Math.log10(max / 5));
  const nice = [1, 2, 5, 10].map((m) => m * step).find((s) => max / s <= 5) ?? step * 10;
  const out = [];
  for (let v = 0; ; v += nice) {
    out.push(v);
    if (v >= max) break;
  }
  return out;
}

/**
 * Stacked bars: series = [{name, cls, values[]}] (same length), labels[i] names bar i.
 * Returns SVG markup; the table beside it carries the same numbers for screen readers.
 */
export function barChart({ series, labels, title, labelEvery = 1 }) {
  const n = labels.length;
  const totals = labels.map((_, i) => series.reduce((s, x) => s + (x.values[i] || 0), 0));
  const axis = ticks(Math.max(0, ...totals));
  const top = axis[axis.length - 1] || 1;
  const plotW = W - PAD.left - PAD.right;
  const plotH = H - PAD.top - PAD.bottom;
  const bw = n ? plotW / n : plotW;
  const y = (v) => PAD.top + plotH - (v / top) * plotH;
  const parts = [];
  for (const v of axis) {
    parts.push(`<line class="grid" x1="${PAD.left}" x2="${W - PAD.right}" y1="${y(v)}" y2="${y(v)}"/>`);
    parts.push(`<text class="tick" x="${PAD.left - 6}" y="${y(v) + 4}" text-anchor="end">${esc(short(v))}</text>`);
  }
  for (const s of series) {
    let d = "";
    for (let i = 0; i < n; i++) {
      const below = series.slice(0, series.indexOf(s)).reduce((a, x) => a + (x.values[i] || 0), 0);
      const v = s.values[i] || 0;
      if (v <= 0) continue;
      const x0 = PAD.left + i * bw + Math.min(1, bw * 0.1);
      const w = Math.max(bw - 2 * Math.min(1, bw * 0.1), 0.5);
      d += `M${x0.toFixed(1)} ${y(below + v).toFixed(1)}h${w.toFixed(2)}V${y(below).toFixed(1)}h${(-w).toFixed(2)}Z`;
    }
    parts.push(`<path class="${esc(s.cls)}" d="${d}"><title>${esc(s.name)}</title></path>`);
  }
  for (let i = 0; i < n; i += labelEvery) {
    parts.push(`<text class="tick" x="${PAD.left + i * bw + bw / 2}" y="${H - 8}" text-anchor="middle">${esc(labels[i])}</text>`);
  }
  const legend = series.map((s) => `<span class="key ${esc(s.cls)}">${esc(s.name)}</span>`).join(" ");
  return `<figure class="chart"><svg viewBox="0 0 ${W} ${H}" role="img" aria-label="${esc(title)}">${parts.join("")}</svg><figcaption>${legend}</figcaption></figure>`;
}

function short(v) {
  const one = (x) => (Number.isInteger(x) ? num(x) : num(x, 1));
  if (v >= 1e9) return `${one(v / 1e9)}G`;
  if (v >= 1e6) return `${one(v / 1e6)}M`;
  if (v >= 1e3) return `${one(v / 1e3)}k`;
  return one(v);
}

/** A run's attempts as horizontal bars on a time axis from the run's arrival. */
export function timeline(attempts, totalMs) {
  const rowH = 26;
  const left = 140;
  const width = 640;
  const end = Math.max(totalMs || 0, ...attempts.map((a) => a.started_ms + a.duration_ms), 1);
  const x = (t) => left + (t / end) * width;
  const rows = attempts.map((a, i) => {
    const y = 8 + i * rowH;
    const w = Math.max(x(a.started_ms + a.duration_ms) - x(a.started_ms), 2);
    const cls = a.outcome === "completed" ? "ok" : a.outcome === "migrated" ? "warn" : "bad";
    return `<text class="tick" x="${left - 6}" y="${y + 15}" text-anchor="end">${esc(a.node)}</text>`
      + `<rect class="${cls}" x="${x(a.started_ms).toFixed(1)}" y="${y}" width="${w.toFixed(1)}" height="${rowH - 8}">`
      + `<title>${esc(`${a.node}: ${a.outcome}${a.reason ? ` (${a.reason})` : ""}, ${a.started_ms} ms + ${a.duration_ms} ms`)}</title></rect>`;
  });
  const h = 8 + attempts.length * rowH + 22;
  const axis = `<line class="grid" x1="${left}" x2="${left + width}" y1="${h - 20}" y2="${h - 20}"/>`
    + `<text class="tick" x="${left}" y="${h - 6}">0 ms</text>`
    + `<text class="tick" x="${left + width}" y="${h - 6}" text-anchor="end">${esc(num(end))} ms</text>`;
  return `<svg class="timeline" viewBox="0 0 ${left + width + 10} ${h}" role="img" aria-label="Attempts of the run on a time axis">${rows.join("")}${axis}</svg>`;
}

/** A sparkline of recent values (the Overview's live figures). */
export function sparkline(values, label) {
  const w = 160;
  const h = 36;
  const max = Math.max(...values, 1e-9);
  const step = values.length > 1 ? w / (values.length - 1) : w;
  const pts = values.map((v, i) => `${(i * step).toFixed(1)},${(h - 2 - (v / max) * (h - 4)).toFixed(1)}`);
  return `<svg class="spark" viewBox="0 0 ${w} ${h}" role="img" aria-label="${esc(label)}"><polyline points="${pts.join(" ")}"/></svg>`;
}
