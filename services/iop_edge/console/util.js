// Small helpers every page uses: escaping, formatting, element lookup.
// All text from the server (node ids, model names, error messages) is peer-controlled:
// it reaches the DOM only through esc() or textContent.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

/** HTML-escape any value for use in text or a quoted attribute. */
export function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const FORMATS = new Map();

/** A number with thousands separators, or an em dash for null. (Formatters are made once per
 * precision: toLocaleString with options builds one per call, the costliest part of a big table.) */
export function num(value, digits = 0) {
  if (value === null || value === undefined || Number.isNaN(value)) return "—";
  let format = FORMATS.get(digits);
  if (!format) {
    format = new Intl.NumberFormat("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits });
    FORMATS.set(digits, format);
  }
  return format.format(value);
}

/** Milliseconds, shown as ms below a second and s above. */
export function ms(value) {
  if (value === null || value === undefined) return "—";
  return value < 1000 ? `${num(value)} ms` : `${num(value / 1000, 2)} s`;
}

/** Unix seconds as "YYYY-MM-DD HH:MM:SS" in UTC (the platform's buckets are UTC). */
export function time(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  return new Date(seconds * 1000).toISOString().slice(0, 19).replace("T", " ");
}

/** A datetime-local input's value, read as UTC, in unix seconds (null when empty). */
export function parseUtc(value) {
  if (!value) return null;
  const t = Date.parse(`${value}Z`);
  return Number.isNaN(t) ? null : t / 1000;
}

/** Unix seconds as a datetime-local value in UTC. */
export function toInputUtc(seconds) {
  return new Date(seconds * 1000).toISOString().slice(0, 16);
}

/** The element with this id inside root (throws when missing: a page bug, not a data case). */
export function $(root, selector) {
  const el = root.querySelector(selector);
  if (!el) throw new Error(`missing element ${selector}`);
  return el;
}

/** Build a query string from the non-empty entries of an object. */
export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== null && v !== undefined && v !== "") q.set(k, String(v));
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}

/** Save a Blob under a file name through a temporary link (downloads need no CSP source). */
export function saveBlob(blob, filename) {
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = filename;
  a.hidden = true;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}

/** Fill a form's fields from URL parameters (a link to a filtered page). */
export function prefill(form, params) {
  for (const [name, value] of params ?? []) {
    const field = form.elements.namedItem(name);
    if (field && !field.readOnly) field.value = value;
  }
}

/**
 * Mark a page's data as rendered (performance marks "iop:NAME:dom" now and "iop:NAME:painted"
 * after the next frame): what the render benchmark reads.
 */
export function rendered(name, then = () => {}) {
  performance.clearMarks(`iop:${name}:dom`);
  performance.clearMarks(`iop:${name}:painted`);
  performance.mark(`iop:${name}:dom`);
  afterFrame(() => {
    performance.mark(`iop:${name}:painted`);
    then();
  });
}

/** Run fn once the browser has painted a frame (rAF runs just before the paint; the task after it). */
function afterFrame(fn) {
  requestAnimationFrame(() => setTimeout(fn, 0));
}

const FIRST_ROWS = 100;
const MORE_ROWS = 1000;
const filling = new WeakMap();

/**
 * Put rows (HTML strings of escaped text) in a tbody: the first screenful at once, the rest
 * (up to 1,000 more) in the next frame, so that a page of 1,000 rows shows within a frame (a
 * table's layout is the costly part, not the markup). Each chunk lays the whole table out again:
 * in chunks of 250, a 1,000-row Usage table took 1.66 s to complete on a loaded host, 1.12 s so.
 * A later fill of the same tbody stops an earlier one. Marks "iop:NAME:complete" when all are in.
 */
export function fillRows(tbody, rows, name, empty) {
  const token = {};
  filling.set(tbody, token);
  tbody.innerHTML = rows.length ? rows.slice(0, FIRST_ROWS).join("") : empty;
  let next = FIRST_ROWS;
  const more = () => {
    if (filling.get(tbody) !== token) return;
    if (next >= rows.length) {
      performance.clearMarks(`iop:${name}:complete`);
      performance.mark(`iop:${name}:complete`);
      return;
    }
    tbody.insertAdjacentHTML("beforeend", rows.slice(next, next + MORE_ROWS).join(""));
    next += MORE_ROWS;
    afterFrame(more);
  };
  rendered(name, more);
}
