// Jobs: the tenant's jobs with state, progress and ETA, tokens/s, goodput; filters; pause, resume, cancel.

import { api, liveJobs } from "./api.js";
import { h, int, notify, num, pct, rate, seconds, stateBadge, when } from "./format.js";

const STATES = ["queued", "running", "paused", "succeeded", "failed", "cancelled"];
const FINISHED = new Set(["succeeded", "failed", "cancelled"]);

/** Which controls a job in `state` offers. */
export function actionsFor(state) {
  if (state === "running" || state === "queued") return ["pause", "cancel"];
  if (state === "paused") return ["resume", "cancel"];
  return [];
}

/** Seconds left: the API's estimate when it gives one, else the pace so far (steps per wall second). */
export function etaSeconds(job) {
  if (job.etaSeconds != null) return job.etaSeconds;
  if (job.state !== "running" || !job.maxSteps || !job.globalStep) return null;
  const elapsed = (Date.parse(job.updatedAt) - Date.parse(job.createdAt)) / 1000;
  if (!(elapsed > 0)) return null;
  return ((job.maxSteps - job.globalStep) * elapsed) / job.globalStep;
}

export async function control(ctx, jobId, action, label) {
  const verbs = { cancel: "Cancel", pause: "Pause", resume: "Resume" };
  const consequence = {
    cancel: "It stops and ends cancelled; this cannot be undone.",
    pause: "It writes a checkpoint and releases its devices.",
    resume: "It queues again and continues from its latest READY checkpoint.",
  };
  if (!(await ctx.confirm(`${verbs[action]} ${label}? ${consequence[action]}`, `${verbs[action]} job`))) return null;
  return api(`/v1/training-jobs/${jobId}/${action}`, { method: "POST" });
}

function actionButtons(ctx, job, after) {
  return h("div", { class: "actions" }, ...actionsFor(job.state).map((action) =>
    h("button", {
      type: "button", "data-action": action, "aria-label": `${action} ${job.name || job.jobId}`,
      class: action === "cancel" ? "danger" : null,
      onclick: async (e) => {
        e.currentTarget.disabled = true;
        try { await control(ctx, job.jobId, action, job.name || job.jobId); await after(); }
        catch (err) { notify(err.message); }
        finally { if (e.currentTarget) e.currentTarget.disabled = false; }
      },
    }, action[0].toUpperCase() + action.slice(1))));
}

function row(ctx, job, refresh) {
  const done = job.maxSteps ? Math.min(1, job.globalStep / job.maxSteps) : 0;
  const eta = FINISHED.has(job.state) ? null : etaSeconds(job);
  return h("tr", { "data-job": job.jobId, "data-state": job.state },
    h("td", {}, h("a", { href: `#/jobs/${job.jobId}` }, job.name || job.jobId), h("div", { class: "muted" }, job.jobId)),
    h("td", {}, stateBadge(job.state), job.queuedReason ? h("div", { class: "muted" }, job.queuedReason) : null,
      job.reason ? h("div", { class: "muted" }, job.reason) : null),
    h("td", {}, h("div", { class: "bar", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": job.maxSteps, "aria-valuenow": job.globalStep, "aria-label": `step ${job.globalStep} of ${job.maxSteps}` }, h("span", { style: `width:${(done * 100).toFixed(1)}%` })),
      h("div", { class: "muted" }, `${int(job.globalStep)} / ${int(job.maxSteps)} steps`)),
    h("td", { class: "num" }, eta == null ? "—" : seconds(eta)),
    h("td", { class: "num" }, rate(job.tokensPerSecond, "tok")),
    h("td", { class: "num" }, job.goodput == null ? "—" : pct(typeof job.goodput === "object" ? job.goodput.goodput : job.goodput)),
    h("td", { class: "num" }, num(job.lastLoss, 4)),
    h("td", {}, `${job.gpuCount} × ${job.model}`, h("div", { class: "muted" }, job.dataset)),
    h("td", {}, when(job.createdAt)),
    h("td", {}, actionButtons(ctx, job, refresh)));
}

export async function render(main, { query }, ctx) {
  const state = query.get("state") || "";
  const name = query.get("name") || "";
  const stateSelect = h("select", { id: "filter-state", name: "state" }, h("option", { value: "" }, "any"),
    ...STATES.map((s) => h("option", { value: s, selected: s === state }, s)));
  const nameInput = h("input", { id: "filter-name", name: "name", type: "search", value: name, placeholder: "part of the name or id" });
  const filters = h("form", { class: "filters", role: "search", "aria-label": "Filter jobs" },
    h("label", { for: "filter-state" }, "State", stateSelect),
    h("label", { for: "filter-name" }, "Name", nameInput),
    h("button", { type: "submit" }, "Filter"));
  filters.addEventListener("submit", (e) => {
    e.preventDefault();
    const q = new URLSearchParams();
    if (stateSelect.value) q.set("state", stateSelect.value);
    if (nameInput.value.trim()) q.set("name", nameInput.value.trim());
    location.hash = `#/jobs${q.toString() ? "?" + q : ""}`;
  });
  stateSelect.addEventListener("change", () => filters.requestSubmit());

  const body = h("tbody", { id: "jobs-body" });
  const more = h("button", { type: "button", id: "jobs-more", hidden: true }, "More jobs");
  const table = h("table", { id: "jobs-table" },
    h("thead", {}, h("tr", {}, ...["Job", "State", "Progress", "ETA", "Tokens/s", "Goodput", "Loss", "Resources", "Submitted", "Actions"]
      .map((t, i) => h("th", { scope: "col", class: i >= 3 && i <= 6 ? "num" : null }, t)))), body);
  main.replaceChildren(h("h1", {}, "Jobs"), filters, h("div", { class: "card" }, table, more));

  const shown = new Map();
  let offset = 0;
  // goodput lives in the job's view, not in the list's summaries (tokens/s and the ETA do): read once per job and
  // again at most every 10 s while it changes
  const extra = new Map(); // jobId -> {at, tokensPerSecond, goodput}
  const enrich = (j) => {
    const known = extra.get(j.jobId);
    if (j.goodput !== undefined || (known && (Date.now() - known.at < 10_000 || FINISHED.has(j.state) && known.final))) return;
    extra.set(j.jobId, { ...known, at: Date.now() });
    api(`/v1/training-jobs/${j.jobId}`, { signal: ctx.signal }).then((v) => {
      extra.set(j.jobId, { at: Date.now(), final: FINISHED.has(v.state), tokensPerSecond: v.progress?.tokensPerSecond ?? null, goodput: v.goodput?.goodput ?? null });
      const tr = shown.get(j.jobId);
      if (tr) { const fresh = row(ctx, withExtra(latest.get(j.jobId) || j), refresh); tr.replaceWith(fresh); shown.set(j.jobId, fresh); }
    }, () => {});
  };
  const latest = new Map();
  const withExtra = (j) => { const e = extra.get(j.jobId); return e ? { tokensPerSecond: e.tokensPerSecond, goodput: e.goodput, ...j } : j; };
  const matches = (j) => (!state || j.state === state) && (!name || `${j.name || ""} ${j.jobId}`.toLowerCase().includes(name.toLowerCase()));
  const put = (j) => {
    if (!matches(j)) { shown.get(j.jobId)?.remove(); shown.delete(j.jobId); return; }
    latest.set(j.jobId, j);
    enrich(j);
    const tr = row(ctx, withExtra(j), refresh);
    const old = shown.get(j.jobId);
    if (old) old.replaceWith(tr); else body.prepend(tr);
    shown.set(j.jobId, tr);
  };
  async function load(from) {
    const q = new URLSearchParams({ offset: String(from) });
    if (state) q.set("state", state);
    const page = await api(`/v1/training-jobs?${q}`, { signal: ctx.signal });
    for (const j of page.jobs) {
      if (!matches(j)) continue;
      latest.set(j.jobId, j);
      enrich(j);
      const tr = row(ctx, withExtra(j), refresh);
      const old = shown.get(j.jobId);
      if (old) old.replaceWith(tr); else body.append(tr);
      shown.set(j.jobId, tr);
    }
    offset = page.nextOffset;
    more.hidden = offset == null;
  }
  async function refresh() {
    const q = new URLSearchParams(state ? { state } : {});
    const page = await api(`/v1/training-jobs?${q}`, { signal: ctx.signal });
    for (const j of page.jobs.slice().reverse()) put(j);
  }
  more.addEventListener("click", () => load(offset));
  await load(0);
  if (!shown.size) body.append(h("tr", { class: "empty" }, h("td", { colspan: 10, class: "muted" }, "No jobs yet: submit one with `trainyard submit examples/tiny.yaml`.")));
  liveJobs({ onJob: (j) => { body.querySelector("tr.empty")?.remove(); put(j); }, poll: refresh, signal: ctx.signal });
}
