// The dashboard shell: sign-in with a token, hash routes, one AbortController per page (streams end when
// the user leaves the page), the confirmation dialog.

import { api, ApiError, session } from "./api.js";
import { h } from "./format.js";
import * as jobs from "./jobs.js";
import * as job from "./job.js";
import * as experiments from "./experiments.js";
import * as cluster from "./cluster.js";
import * as lab from "./lab.js";

const ROUTES = [
  [/^#\/jobs$/, jobs.render, "jobs"],
  [/^#\/jobs\/([\w-]+)$/, job.render, "jobs"],
  [/^#\/experiments$/, experiments.render, "experiments"],
  [/^#\/experiments\/([\w-]+)$/, experiments.renderOne, "experiments"],
  [/^#\/cluster$/, cluster.render, "cluster"],
  [/^#\/goodput$/, cluster.renderGoodput, "goodput"],
  [/^#\/lab$/, lab.render, "lab"],
];

const main = document.getElementById("main");
let page = null; // the current page's AbortController
let me = null;

/** Ask before doing something that cannot be undone; resolves true on Confirm (Enter), false on Escape. */
export function confirmAction(text, confirmLabel = "Confirm") {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-yes").textContent = confirmLabel;
  dialog.returnValue = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.showModal();
    document.getElementById("confirm-yes").focus();
  });
}

function showSignIn(message) {
  page?.abort();
  me = null;
  document.getElementById("nav").hidden = true;
  document.getElementById("sign-out").hidden = true;
  document.getElementById("who").textContent = "";
  const input = h("input", { id: "token", name: "token", type: "password", autocomplete: "off", required: true, "aria-describedby": "token-help" });
  const form = h("form", { class: "card signin", id: "signin" },
    h("h1", {}, "Sign in to trainyard"),
    message ? h("p", { class: "error", role: "alert", id: "signin-error" }, message) : null,
    h("label", { for: "token" }, "API token", input),
    h("p", { class: "muted", id: "token-help" }, "Paste a token: `make up` prints the dev stack's (also in .trainyard/dev-token); an admin issues others with `trainyard admin tokens create` (docs/tenants.md). It is kept in this tab only."),
    h("button", { type: "submit", class: "primary", id: "signin-submit" }, "Sign in"));
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    session.signIn(input.value.trim());
    await start();
  });
  main.replaceChildren(form);
  input.focus();
}

async function start() {
  if (!session.token()) return showSignIn(null);
  try {
    me = await api("/v1/whoami");
  } catch (e) {
    session.signOut();
    return showSignIn(e instanceof ApiError && e.status === 401 ? `The API refused this token: ${e.message}` : `Could not reach the API: ${e.message}`);
  }
  document.getElementById("nav").hidden = false;
  document.getElementById("sign-out").hidden = false;
  document.getElementById("who").textContent = `${me.name} · ${me.tenant} · ${me.role}`;
  if (!location.hash || location.hash === "#/" || location.hash === "#") location.hash = "#/jobs";
  else route();
}

async function route() {
  if (!me) return;
  page?.abort();
  page = new AbortController();
  document.getElementById("notice").hidden = true;
  const signal = page.signal;
  const hash = location.hash.split("?")[0];
  const query = new URLSearchParams(location.hash.split("?")[1] || "");
  for (const [pattern, render, name] of ROUTES) {
    const m = hash.match(pattern);
    if (!m) continue;
    for (const a of document.querySelectorAll("#nav a")) {
      if (a.dataset.page === name) a.setAttribute("aria-current", "page");
      else a.removeAttribute("aria-current");
    }
    main.replaceChildren(h("p", { class: "muted" }, "Loading…"));
    try {
      await render(main, { id: m[1], query }, { signal, me, confirm: confirmAction });
    } catch (e) {
      if (signal.aborted) return;
      if (e instanceof ApiError && e.status === 401) return showSignIn(`The API refused this token: ${e.message}`);
      main.replaceChildren(h("p", { class: "error", role: "alert" }, e.message));
    }
    return;
  }
  location.hash = "#/jobs";
}

window.addEventListener("hashchange", route);
window.addEventListener("unhandledrejection", (e) => {
  if (e.reason instanceof ApiError && e.reason.status === 401) { e.preventDefault(); session.signOut(); showSignIn(`The API refused this token: ${e.reason.message}`); }
});
window.addEventListener("trainyard:token-refused", (e) => { session.signOut(); showSignIn(`The API refused this token: ${e.detail}`); });
document.getElementById("sign-out").addEventListener("click", () => { session.signOut(); showSignIn(null); });
start();
