// Experiments (sweeps): the tenant's experiments; one experiment's search — its trials with their point, state,
// metric at each rung and why they stopped, the space as a scatter per parameter (and parallel coordinates when
// several are searched), the best trial with its job and checkpoint; Stop. Refreshes while the search runs.

import { api } from "./api.js";
import { h, int, label, notify, num, seconds, stateBadge, when } from "./format.js";
import { chartLegend, parallelCoordinates, scatterPlot } from "./charts.js";

const OVER = new Set(["completed", "stopped", "failed"]);
/** A trial's colour on the charts: how it ended, or "running" while it is in the race (waiting at a rung too). */
export const STATE_COLORS = { completed: "#1f7a3f", stopped: "#e8b04a", failed: "#b3261e", running: "#2456c7" };
export const colorGroup = (state) => (OVER.has(state) ? state : "running");
const REFRESH_MS = 2000;

/** What the pages call the searched fields: the path's last part in words, with its parent's where two collide. */
export function paramLabels(paths) {
  const words = (p, n) => p.split(".").slice(-n).map(label).join(" · ");
  const out = {};
  for (const p of paths) {
    const short = words(p, 1);
    out[p] = paths.filter((q) => words(q, 1) === short).length > 1 ? words(p, 2) : short;
  }
  return out;
}

export function paramValue(v) { return typeof v === "number" ? num(v, 3) : String(v); }

/** "learning rate 0.003, warmup steps 20": a trial's point in words. */
export function pointText(params) {
  const names = paramLabels(Object.keys(params || {}));
  return Object.entries(params || {}).map(([k, v]) => `${names[k].toLowerCase()} ${paramValue(v)}`).join(", ");
}

/** Trials over (completed, stopped or failed) and the budget's trials. */
export function trialCounts(view) {
  const done = view.trials.filter((t) => OVER.has(t.state)).length;
  const active = view.trials.filter((t) => ["running", "waiting", "stopping"].includes(t.state)).length;
  return { done, active, total: view.spec.budget.maxTrials };
}

/** The best trial: the API's once the search chose it, else the best value so far by the metric's goal. */
export function bestOf(view) {
  if (view.best) return { ...view.best, soFar: false };
  const sign = view.spec.metric.goal === "maximize" ? -1 : 1;
  const valued = view.trials.filter((t) => Number.isFinite(t.value));
  if (!valued.length) return null;
  const t = valued.reduce((a, b) => (sign * b.value < sign * a.value ? b : a));
  return { trial: t.number, jobId: t.jobId, value: t.value, params: t.params, checkpoint: null, globalStep: null, soFar: true };
}

const metricLabel = (view) => label(view.spec.metric.name);
const goalText = (goal) => (goal === "maximize" ? "higher is better" : "lower is better");
const deviceTime = (hours) => (hours == null ? "—" : seconds(hours * 3600));
const jobLink = (jobId) => (jobId ? h("a", { href: `#/jobs/${jobId}`, "data-job-link": jobId }, jobId) : "—");

function wait(ms, signal) {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(t); resolve(); }, { once: true });
  });
}

/** Read `load()` again every `ms` while `running()` says the search goes on and the page is open. */
async function keepFresh(load, running, signal, ms = REFRESH_MS) {
  while (!signal.aborted && running()) {
    await wait(ms, signal);
    if (signal.aborted) return;
    try { await load(); } catch (e) { if (!signal.aborted) console.warn("experiment refresh failed:", e.message); }
  }
}

// ----------------------------------------------------------------------------- the list

function listRow(view) {
  const { done, active, total } = trialCounts(view);
  const best = bestOf(view);
  return h("tr", { "data-experiment": view.experimentId, "data-state": view.state },
    h("td", {}, h("a", { href: `#/experiments/${view.experimentId}` }, view.name), h("div", { class: "muted" }, view.experimentId)),
    h("td", {}, stateBadge(view.state), view.reason ? h("div", { class: "muted" }, view.reason) : null),
    h("td", { class: "num", "data-done": done, "data-total": total }, `${int(done)} / ${int(total)}`, active ? h("div", { class: "muted" }, `${int(active)} running`) : null),
    h("td", { class: "num" }, best ? num(best.value, 4) : "—",
      best ? h("div", { class: "muted" }, `${metricLabel(view).toLowerCase()}, trial ${best.trial}${best.soFar ? " so far" : ""}`) : null),
    h("td", { class: "num" }, deviceTime(view.deviceHours)),
    h("td", {}, when(view.createdAt)));
}

export async function render(main, _, ctx) {
  const body = h("tbody", { id: "experiments-body" });
  const table = h("table", { id: "experiments-table" },
    h("thead", {}, h("tr", {}, ...["Experiment", "State", "Trials done", "Best", "Device-time", "Created"]
      .map((t, i) => h("th", { scope: "col", class: i >= 2 && i <= 4 ? "num" : null }, t)))), body);
  main.replaceChildren(h("h1", {}, "Experiments"),
    h("p", { class: "muted" }, "Sweeps over a base spec: each trial is an ordinary job; early stopping stops the losers with a checkpoint (docs/experiments.md)."),
    h("div", { class: "card" }, table));
  let views = [];
  async function load() {
    views = (await api("/v1/experiments", { signal: ctx.signal })).experiments.slice().reverse(); // newest first
    body.replaceChildren(...(views.length ? views.map(listRow)
      : [h("tr", { class: "empty" }, h("td", { colspan: 6, class: "muted" }, "No experiments yet: start one with `trainyard experiments create examples/sweep/sweep.yaml --code examples/gpt-sdk`."))]));
  }
  await load();
  keepFresh(load, () => views.some((v) => v.state === "running"), ctx.signal);
}

// ----------------------------------------------------------------------------- one experiment

function section(id, title, ...children) {
  return h("section", { class: "card", id, "aria-labelledby": `${id}-h` }, h("h2", { id: `${id}-h` }, title), ...children);
}

function searchText(spec) {
  const b = spec.budget;
  return `${label(spec.search.algorithm)} (seed ${spec.search.seed}), at most ${int(b.maxTrials)} trials${b.maxDeviceHours ? ` or ${num(b.maxDeviceHours)} device-hours` : ""}, ${int(spec.maxConcurrentTrials)} at a time`;
}

function earlyStoppingText(view) {
  const es = view.spec.earlyStopping;
  if (!es) return "none: every trial runs to the end";
  const rungs = view.rungs.length ? `rungs at step ${view.rungs.map(int).join(", ")}` : "no rung below the last step";
  return `successive halving, ${rungs}; the best 1/${es.reductionFactor} go on at each`;
}

function bestText(view) {
  const best = bestOf(view);
  if (!best) return h("dd", { id: "experiment-best" }, view.state === "running" ? "no trial has a value yet" : "no trial reported the metric");
  return h("dd", { id: "experiment-best", "data-trial": best.trial },
    `trial ${best.trial}${best.soFar ? " (so far)" : ""}: ${metricLabel(view).toLowerCase()} ${num(best.value, 4)} · ${pointText(best.params)} · job `,
    jobLink(best.jobId),
    best.checkpoint ? [" · checkpoint ", h("span", { id: "experiment-best-checkpoint" }, best.checkpoint), best.globalStep != null ? ` (step ${int(best.globalStep)})` : ""] : "");
}

function header(view, ctx, refresh) {
  const { done, active, total } = trialCounts(view);
  const metric = view.spec.metric;
  const mayStop = view.state === "running" && ctx.me?.role !== "viewer";
  const stop = mayStop ? h("button", {
    type: "button", id: "experiment-stop", class: "danger",
    onclick: async (e) => {
      const button = e.currentTarget;
      if (!(await ctx.confirm(`Stop experiment ${view.name}? Its running trials write a checkpoint and stop, and no new trial starts; the best trial so far is kept.`, "Stop experiment"))) return;
      button.disabled = true;
      try { await api(`/v1/experiments/${view.experimentId}/stop`, { method: "POST", signal: ctx.signal }); await refresh(); }
      catch (err) { if (!ctx.signal.aborted) notify(err.message); }
      finally { button.disabled = false; }
    },
  }, "Stop") : null;
  return h("div", { class: "card", id: "experiment-header" },
    h("h1", {}, view.name, " ", stateBadge(view.state, "experiment-state")),
    view.reason ? h("p", { class: "muted", id: "experiment-reason" }, view.reason) : null,
    h("div", { class: "grid" },
      h("dl", { class: "kv words" },
        h("dt", {}, "Metric"), h("dd", { id: "experiment-metric" }, `${metricLabel(view)}${metricLabel(view).toLowerCase() === metric.name.toLowerCase() ? "" : ` (${metric.name})`}: ${metric.goal} (${goalText(metric.goal)})`),
        h("dt", {}, "Best"), bestText(view),
        h("dt", {}, "Trials"), h("dd", { id: "experiment-trials-done" }, `${int(done)} of ${int(total)} done`, active ? `, ${int(active)} running` : ""),
        h("dt", {}, "Device-time"), h("dd", {}, deviceTime(view.deviceHours))),
      h("dl", { class: "kv words" },
        h("dt", {}, "Search"), h("dd", {}, searchText(view.spec)),
        h("dt", {}, "Early stopping"), h("dd", {}, earlyStoppingText(view)),
        h("dt", {}, "Created"), h("dd", {}, when(view.createdAt), h("span", { class: "muted" }, ` · ${view.experimentId}`)),
        h("dt", {}, "Updated"), h("dd", {}, when(view.updatedAt))),
      h("div", { class: "actions" }, stop)));
}

function trialsTable(view) {
  const paths = Object.keys(view.spec.space);
  const names = paramLabels(paths);
  const metric = metricLabel(view);
  const cols = [["#", true], ...paths.map((p) => [names[p], true]), ["State", false], ...view.rungs.map((st) => [`${metric} at step ${int(st)}`, true]),
    [metric, true], ["Last step", true], ["Device-time", true], ["Job", false], ["Why it stopped", false]];
  if (!view.trials.length) return h("p", { class: "muted", id: "trials-empty" }, view.state === "running" ? "No trial yet: the search draws the first points." : "No trial ran.");
  return h("table", { id: "trials" },
    h("thead", {}, h("tr", {}, ...cols.map(([title, numeric]) => h("th", { scope: "col", class: numeric ? "num" : null }, title)))),
    h("tbody", {}, ...view.trials.map((t) => h("tr", { "data-trial": t.number, "data-state": t.state, class: view.best?.trial === t.number ? "best" : null },
      h("td", { class: "num nowrap" }, t.number, view.best?.trial === t.number ? h("span", { class: "best-mark", title: "the best trial" }, " ★") : ""),
      ...paths.map((p) => h("td", { class: "num", "data-param": p }, t.params[p] == null ? "—" : paramValue(t.params[p]))),
      h("td", {}, stateBadge(t.state)),
      ...view.rungs.map((_, i) => h("td", { class: "num" }, t.rungs[i] == null ? "—" : num(t.rungs[i], 4))),
      h("td", { class: "num", "data-value": t.value ?? "" }, num(t.value, 4)),
      h("td", { class: "num" }, int(t.lastStep)),
      h("td", { class: "num" }, deviceTime(t.deviceHours)),
      h("td", {}, jobLink(t.jobId)),
      h("td", {}, t.reason || "—")))));
}

function rungsTable(view) {
  if (!view.rungDecisions.length) return null;
  const list = (ns) => (ns.length ? ns.map((n) => `trial ${n}`).join(", ") : "—");
  return h("table", { id: "rung-decisions" }, h("caption", {}, "Rung decisions"),
    h("thead", {}, h("tr", {}, ...["Rung", "At step", "Went on", "Stopped"].map((t, i) => h("th", { scope: "col", class: i < 2 ? "num" : null }, t)))),
    h("tbody", {}, ...view.rungDecisions.map((d) => h("tr", { "data-rung": d.rung },
      h("td", { class: "num" }, d.rung + 1), h("td", { class: "num" }, int(d.steps)), h("td", {}, list(d.promoted)), h("td", {}, list(d.stopped))))));
}

/** How a searched parameter's axis is scaled: its values in order (categorical), whole numbers, or a log scale. */
export function axisOf(param) {
  if (param.type === "categorical") return { categories: param.values };
  return { log: !!param.log, integer: param.type === "int" };
}

function spacePicture(view) {
  const paths = Object.keys(view.spec.space);
  const names = paramLabels(paths);
  const metric = metricLabel(view);
  const bestTrial = bestOf(view)?.trial;
  const tip = (t) => `trial ${t.number} (${t.state}): ${metric.toLowerCase()} ${num(t.value, 4)} · ${pointText(t.params)}`;
  const mark = (t) => ({ key: t.number, state: t.state, color: STATE_COLORS[colorGroup(t.state)], best: t.number === bestTrial, title: tip(t) });
  const figures = paths.map((p) => {
    const param = view.spec.space[p];
    const points = view.trials.map((t) => ({ ...mark(t), x: t.params[p], y: t.value }));
    return h("figure", { "data-param": p },
      h("figcaption", {}, h("strong", {}, `${metric} against ${names[p].toLowerCase()}`), h("span", { class: "muted" }, param.log ? " (log scale)" : "")),
      scatterPlot({ name: p, label: `${metric} against ${names[p].toLowerCase()}`, points, x: axisOf(param), xTitle: names[p], yTitle: metric }));
  });
  const parallel = paths.length > 1 ? h("figure", { id: "space-parallel" },
    h("figcaption", {}, h("strong", {}, "Every searched parameter and the metric"), h("span", { class: "muted" }, " (one line per trial with a value)")),
    parallelCoordinates({
      name: "space", label: "parallel coordinates of the trials",
      axes: [...paths.map((p) => ({ key: p, title: names[p], ...axisOf(view.spec.space[p]) })), { key: "=metric", title: metric }],
      rows: view.trials.map((t) => ({ ...mark(t), values: { ...t.params, "=metric": t.value } })),
    })) : null;
  const legend = chartLegend(Object.entries(STATE_COLORS).map(([k, color]) => ({ label: k === "running" ? "running or waiting" : k, color })));
  legend.append(h("span", {}, h("span", { class: "swatch best-swatch" }), bestTrial != null && bestOf(view).soFar ? "best so far" : "best"));
  return h("div", {}, h("div", { class: "charts", id: "space" }, ...figures, parallel), legend);
}

export async function renderOne(main, { id }, ctx) {
  let view = await api(`/v1/experiments/${id}`, { signal: ctx.signal });
  const head = h("div", {});
  const space = section("space-section", "The space searched");
  const trials = section("trials-section", "Trials");
  const paint = () => {
    const focused = document.activeElement?.id; // a keyboard user keeps their place across refreshes
    head.replaceChildren(header(view, ctx, refresh));
    space.replaceChildren(space.firstChild, h("p", { class: "muted" }, `Each trial's ${metricLabel(view).toLowerCase()} (its last value) against the point it tried; trials without a value yet are not drawn.`), spacePicture(view));
    trials.replaceChildren(...[trials.firstChild, trialsTable(view), rungsTable(view)].filter(Boolean));
    if (focused && document.activeElement?.id !== focused) document.getElementById(focused)?.focus();
  };
  async function refresh() {
    view = await api(`/v1/experiments/${id}`, { signal: ctx.signal });
    paint();
  }
  paint();
  main.replaceChildren(h("p", {}, h("a", { href: "#/experiments" }, "← Experiments")), head, space, trials);
  // trials stopped by a stop request still write their checkpoint after the experiment's state changed
  keepFresh(refresh, () => view.state === "running" || view.trials.some((t) => ["running", "waiting", "stopping"].includes(t.state)), ctx.signal);
}
