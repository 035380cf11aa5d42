// Usage: tokens per key and model by hour or day from the ledger, as a bar chart (prompt and
// completion tokens stacked per bucket), a table, and a CSV file fetched with the key.

import { api, request } from "./api.js";
import { barChart, busy, toast } from "./ui.js";
import { $, esc, fillRows, num, parseUtc, prefill, query, saveBlob, time, toInputUtc } from "./util.js";

const PRESETS = { "24h": 86400, "7d": 7 * 86400, "30d": 30 * 86400 };
const BUCKET_S = { hour: 3600, day: 86400 };
const TABLE_ROWS = 1000;
/** Rows the table shows (the newest): 30 days by hour for many keys and models is tens of
 * thousands; the chart and the totals count every row, and the CSV has them all. */

export function render(main, { me, signal, params: link }) {
  main.innerHTML = `
    <h1>Usage</h1>
    <form class="filters" id="filter">
      <div><label for="u-range">Range</label>
        <select id="u-range" name="range"><option value="24h">last 24 hours</option>
          <option value="7d">last 7 days</option><option value="30d">last 30 days</option>
          <option value="custom">custom</option></select></div>
      <div class="custom" hidden><label for="u-start">Start (UTC)</label><input id="u-start" name="start" type="datetime-local"></div>
      <div class="custom" hidden><label for="u-end">End (UTC)</label><input id="u-end" name="end" type="datetime-local"></div>
      <div><label for="u-bucket">Bucket</label>
        <select id="u-bucket" name="bucket"><option>hour</option><option>day</option></select></div>
      <div><label for="u-key">Key</label><input id="u-key" name="key" spellcheck="false"
        ${me.admin ? "" : `value="${esc(me.key)}" readonly`}></div>
      <div><label for="u-model">Model</label><input id="u-model" name="model" spellcheck="false"></div>
      <div><label for="u-group">Rows per</label>
        <select id="u-group" name="group"><option value="key">key</option>
          <option value="model">model</option><option value="key,model">key and model</option></select></div>
      <div class="submit"><button type="submit" class="primary">Show</button>
        <button type="button" id="csv">Export CSV</button></div>
    </form>
    <p class="status" id="summary" aria-live="polite"></p>
    <div id="chart"></div>
    <div class="table-wrap"><table id="usage-table">
      <thead><tr><th scope="col">Start (UTC)</th><th scope="col">Key</th><th scope="col">Model</th>
        <th scope="col" class="n">Requests</th><th scope="col" class="n">Prompt tokens</th>
        <th scope="col" class="n">Completion tokens</th><th scope="col" class="n">Cached tokens</th>
        <th scope="col" class="n">Failed</th></tr></thead>
      <tbody id="rows"></tbody><tfoot id="totals"></tfoot>
    </table></div>`;
  const form = $(main, "#filter");
  const range = $(form, "#u-range");
  const showCustom = () => {
    for (const el of form.querySelectorAll(".custom")) el.hidden = range.value !== "custom";
  };
  prefill(form, link);
  showCustom();
  range.addEventListener("change", () => {
    showCustom();
    if (range.value === "custom" && !$(form, "#u-start").value) {
      const now = Date.now() / 1000;
      $(form, "#u-start").value = toInputUtc(now - 86400);
      $(form, "#u-end").value = toInputUtc(now);
    }
    if (range.value === "30d" || range.value === "7d") $(form, "#u-bucket").value = "day";
    if (range.value === "24h") $(form, "#u-bucket").value = "hour";
  });
  const load = async () => {
    try {
      show(main, await api(`/console/api/usage${query(params(form))}`, { signal }));
    } catch (err) {
      if (err.name !== "AbortError") toast(err.message, "error");
    }
  };
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    load();
  });
  const csv = $(form, "#csv");
  csv.addEventListener("click", () => busy(csv, async () => {
    const response = await request(`/console/api/usage.csv${query(params(form))}`, { signal });
    const disposition = response.headers.get("Content-Disposition") || "";
    const name = /filename="?([^";]+)"?/.exec(disposition)?.[1] || "iop-usage.csv";
    saveBlob(await response.blob(), name);
    toast(`Saved ${name}`);
  }));
  load();
}

/** The query of the form: a preset is now minus its span, custom reads the UTC inputs. */
function params(form) {
  const f = new FormData(form);
  const now = Date.now() / 1000;
  let start = null;
  let end = null;
  const preset = f.get("range");
  if (preset === "custom") {
    start = parseUtc(f.get("start"));
    end = parseUtc(f.get("end"));
  } else {
    start = Math.floor(now - PRESETS[preset]);
    end = Math.floor(now);
  }
  return {
    start, end, bucket: f.get("bucket"), key: f.get("key").trim(), model: f.get("model").trim(), group: f.get("group"),
  };
}

function show(main, usage) {
  const size = BUCKET_S[usage.bucket] || 3600;
  const first = Math.floor(usage.start / size) * size;
  const count = Math.max(1, Math.ceil((usage.end - first) / size));
  const prompt = new Array(count).fill(0);
  const completion = new Array(count).fill(0);
  for (const r of usage.rows) {
    const i = Math.floor((r.start - first) / size);
    if (i < 0 || i >= count) continue;
    prompt[i] += r.prompt_tokens;
    completion[i] += r.completion_tokens;
  }
  const labels = Array.from({ length: count }, (_, i) => {
    const iso = new Date((first + i * size) * 1000).toISOString();
    return usage.bucket === "day" ? iso.slice(5, 10) : iso.slice(11, 13) === "00" ? iso.slice(5, 10) : iso.slice(11, 16);
  });
  $(main, "#chart").innerHTML = barChart({
    series: [
      { name: "prompt tokens", cls: "s1", values: prompt },
      { name: "completion tokens", cls: "s2", values: completion },
    ],
    labels,
    labelEvery: Math.max(1, Math.ceil(count / 12)),
    title: `Tokens per ${usage.bucket} from ${time(usage.start)} to ${time(usage.end)} UTC`,
  });
  const shown = usage.rows.slice(-TABLE_ROWS).reverse();
  fillRows($(main, "#rows"), shown.map((r) => `<tr><td>${time(r.start)}</td><td>${esc(r.key ?? "all")}</td><td>${esc(r.model ?? "all")}</td>
        <td class="n">${num(r.requests)}</td><td class="n">${num(r.prompt_tokens)}</td>
        <td class="n">${num(r.completion_tokens)}</td><td class="n">${num(r.cached_tokens)}</td>
        <td class="n">${num(r.failed)}</td></tr>`), "usage", `<tr><td colspan="8">No usage in this range.</td></tr>`);
  const t = usage.totals;
  $(main, "#totals").innerHTML = `<tr><th scope="row" colspan="3">Total</th><td class="n" id="total-requests">${num(t.requests)}</td>
    <td class="n" id="total-prompt">${num(t.prompt_tokens)}</td><td class="n" id="total-completion">${num(t.completion_tokens)}</td>
    <td class="n">${num(t.cached_tokens)}</td><td class="n">${num(t.failed)}</td></tr>`;
  const cut = usage.rows.length > shown.length ? ` The table shows the newest ${num(shown.length)}; the CSV has them all.` : "";
  $(main, "#summary").textContent = `${num(usage.rows.length)} rows by ${usage.bucket}, ${time(usage.start)} to ${time(usage.end)} UTC, newest first.${cut}`;
}
