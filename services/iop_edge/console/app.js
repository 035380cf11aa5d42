// The console's shell: sign-in with an API key, the nav (admin pages hidden for other keys),
// and hash routing (#/overview, #/nodes, ...; a query after the page's name, e.g.
// #/runs?model=m&limit=500, fills its filters). Each page module exports render(main, ctx) and
// may return a function that stops it (streams, timers) on leaving.

import { ApiError, api, forgetKey, onUnauthorized, saveKey, savedKey } from "./api.js";
import { stopLive } from "./live.js";
import { $, esc } from "./util.js";
import * as overview from "./overview.js";
import * as nodes from "./nodes.js";
import * as runs from "./runs.js";
import * as usage from "./usage.js";
import * as keys from "./keys.js";
import * as batches from "./batches.js";
import * as playground from "./playground.js";

const PAGES = {
  overview: { module: overview, title: "Overview" },
  nodes: { module: nodes, title: "Nodes", admin: true },
  runs: { module: runs, title: "Runs" },
  usage: { module: usage, title: "Usage" },
  keys: { module: keys, title: "Keys", admin: true },
  batches: { module: batches, title: "Batches" },
  playground: { module: playground, title: "Playground" },
};

const main = document.getElementById("main");
const WHO = "iop.console.me";
/** Who the key is, kept beside it in sessionStorage: a reload shows the page at once while
 * /console/api/me checks the key again (a refused key signs out). */
let me = null;
let leave = null;

function showSignIn(message = "") {
  stopPage();
  me = null;
  $(document, "#nav").hidden = true;
  $(document, "#who").hidden = true;
  document.title = "Sign in · IOP console";
  main.innerHTML = `
    <h1 tabindex="-1">Sign in</h1>
    <form id="sign-in" class="card narrow">
      <label for="key">API key</label>
      <input id="key" name="key" type="password" autocomplete="off" required spellcheck="false">
      <p class="hint">Kept in this tab only (sessionStorage) and sent with every call. With <code>auth: none</code> any text will do.</p>
      <p id="sign-in-error" class="error" role="alert">${esc(message)}</p>
      <button type="submit" class="primary">Sign in</button>
    </form>`;
  const form = $(main, "#sign-in");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = $(form, "#key").value.trim();
    try {
      const who = await api("/console/api/me", { key });
      saveKey(key);
      signedIn(who);
    } catch (err) {
      const text = err instanceof ApiError && err.status === 401 ? "Wrong key." : err.message;
      $(form, "#sign-in-error").textContent = text;
    }
  });
  $(form, "#key").focus();
}

function signedIn(who) {
  sessionStorage.setItem(WHO, JSON.stringify(who));
  me = who;
  $(document, "#who-name").textContent = `${who.key}${who.admin ? " (admin)" : ""} · ${who.edge}`;
  $(document, "#who").hidden = false;
  $(document, "#nav").hidden = false;
  for (const li of document.querySelectorAll("#nav [data-admin]")) li.hidden = !who.admin;
  route();
}

function stopPage() {
  if (leave) leave();
  leave = null;
}

function route() {
  if (!me) return;
  const hash = location.hash;
  if (!hash.startsWith("#/")) {
    location.replace("#/overview");
    return;
  }
  const [path, search = ""] = hash.slice(2).split("?");
  let name = path;
  if (!PAGES[name] || (PAGES[name].admin && !me.admin)) name = "overview";
  const page = PAGES[name];
  stopPage();
  for (const a of document.querySelectorAll("#nav a")) {
    if (a.getAttribute("href") === `#/${name}`) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  document.title = `${page.title} · IOP console`;
  main.innerHTML = "";
  const controller = new AbortController();
  const params = new URLSearchParams(search);
  const stop = page.module.render(main, { me, signal: controller.signal, params });
  leave = () => {
    controller.abort();
    if (typeof stop === "function") stop();
  };
  const h1 = main.querySelector("h1");
  if (h1) {
    h1.tabIndex = -1;
    h1.focus({ preventScroll: true });
  }
}

function signOut() {
  stopLive();
  forgetKey();
  sessionStorage.removeItem(WHO);
  history.replaceState(null, "", location.pathname);
  showSignIn();
}

async function boot() {
  $(document, "#sign-out").addEventListener("click", signOut);
  window.addEventListener("hashchange", route);
  onUnauthorized((message) => {
    if (!me) return;
    stopLive();
    forgetKey();
    sessionStorage.removeItem(WHO);
    showSignIn(`Signed out: ${message}`);
  });
  const key = savedKey();
  if (!key) {
    showSignIn();
    return;
  }
  const known = sessionStorage.getItem(WHO);
  if (known) signedIn(JSON.parse(known));
  try {
    const who = await api("/console/api/me");
    if (!known || who.admin !== me?.admin) signedIn(who);
  } catch (err) {
    const refused = err instanceof ApiError && err.status === 401;
    if (known && refused) return; // onUnauthorized signed out
    if (refused) forgetKey();
    if (!known) showSignIn(refused ? "Signed out: the key was refused." : err.message);
  }
}

boot();
