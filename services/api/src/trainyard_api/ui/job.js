// Job: state and progress (live), spec and lineage, attempts timeline, curves with the checkpoints'
// evaluations, per-rank heat map, checkpoints, goodput, log tail per rank; actions; "Open in the Lab".

import { api, liveJobs, stream } from "./api.js";
import { bytes, h, int, label, notify, num, pct, rate, seconds, stateBadge, when } from "./format.js";
import { heatMap, lineChart, stackedBar } from "./charts.js";
import { actionsFor, control, etaSeconds } from "./jobs.js";
import { pointText } from "./experiments.js";

const CURVES = ["loss", "lr", "tokensPerSecond", "mfu"];
const TIMING = ["computeSeconds", "collectiveSeconds", "dataWaitSeconds", "checkpointSeconds"];
const WASTE_COLORS = { lostWork: "#e07b73", launchRestore: "#e8b04a", checkpointStall: "#b48ad6", hang: "#7f8896", replicaDown: "#6fa8c7", idle: "#c9ced6" };
const MAX_POINTS = 2000;
const HEAT_BUCKETS = 60;
const EVAL_POLL_MS = 5000;
// an evaluation job queues for devices like any job: its result may come this long after the job ended
const EVAL_GRACE_MS = 10 * 60 * 1000;

/** The Lab's inputs from what the job says of itself: model, layout, measured step and checkpoint times. */
export function labQuery(view) {
  const spec = view.spec, t = spec.training || {}, p = spec.parallelism || {}, r = spec.resources || {};
  const q = new URLSearchParams();
  q.set("model", typeof spec.modelConfig === "string" ? spec.modelConfig : JSON.stringify(spec.modelConfig));
  q.set("device", r.gpuType || "");
  q.set("devices", String(r.gpuCount || 1));
  const perNode = Number(String(r.topology || "").match(/^(\d+)-device/)?.[1]);
  if (perNode) q.set("devicesPerNode", String(perNode));
  if (p.data) q.set("data", String(p.data));
  if (t.microBatchSize) q.set("microBatch", String(t.microBatchSize));
  if (t.sequenceLength) q.set("sequenceLength", String(t.sequenceLength));
  if (t.globalBatchSize) q.set("globalBatch", String(t.globalBatchSize));
  const timing = view.rankTiming || [];
  const step = timing.length ? Math.max(...timing.map((x) => x.stepSeconds - (x.checkpointSeconds || 0))) : null;
  if (step > 0) {
    q.set("stepSeconds", step.toPrecision(4));
    const last = view.attempts.at(-1);
    if (last) q.set("measuredNodes", String(new Set(last.nodes).size || 1));
  }
  const writes = (view.checkpoints || []).map((c) => c.writeSeconds).filter((w) => w > 0);
  if (writes.length) q.set("writeSeconds", Math.max(...writes).toPrecision(4));
  else if (view.checkpointAdvice?.inputs?.writeSeconds) q.set("writeSeconds", String(view.checkpointAdvice.inputs.writeSeconds));
  return q;
}

const FINISHED = new Set(["succeeded", "failed", "cancelled"]);
const ENDED = { succeeded: "succeeded", failed: "failed", cancelled: "was cancelled" };

/** How a finished job ended, for the parts it left empty: "the job was cancelled before its first step (…)". */
export function endedText(view) {
  const steps = view.progress?.globalStep || 0;
  const at = view.attempts.at(-1)?.endedAt || view.updatedAt;
  const where = !view.attempts.length ? "before it started" : steps ? `at step ${int(steps)}` : "before its first step";
  return `the job ${ENDED[view.state] || view.state} ${where}${at ? ` (${when(at)})` : ""}`;
}

/** What an empty part of a job's page says: `live` while the job may still fill it, `done` once it cannot. */
export function emptyText(view, live, done) {
  return FINISHED.has(view.state) ? done : live;
}

/** What a curve without points says: "no data yet" while the job runs; once finished, what happened. */
export function emptyCurveText(view, name, othersHaveData) {
  if (!FINISHED.has(view.state)) return "no data yet";
  if (othersHaveData) return `${label(name)} was not reported by this run`;
  return `no metrics were recorded: ${endedText(view)}`;
}

/** An evaluation's metrics in words, loss and perplexity first: "Loss 2.312 · perplexity 10.09". */
export function metricsText(metrics) {
  return metricNames([{ metrics }]).map((k) => `${label(k)} ${num(metrics[k], 4)}`).join(" · ");
}

/** The metrics the evaluations report, as table columns: loss, perplexity, then the others by name. */
export function metricNames(evaluations) {
  const first = ["loss", "perplexity"];
  const names = new Set(evaluations.flatMap((e) => Object.keys(e.metrics || {})));
  return [...first.filter((k) => names.has(k)), ...[...names].filter((k) => !first.includes(k)).sort()];
}

/** The loss chart's second series: a marker per evaluation that reported a loss (the held-out loss), at its step. */
export function evaluationMarkers(evaluations) {
  return evaluations.filter((e) => Number.isFinite(e.metrics?.loss)).map((e) => ({
    key: e.evaluationJobId, step: e.globalStep, value: e.metrics.loss, href: `#/jobs/${e.evaluationJobId}`,
    title: `Evaluation (held-out) of step ${int(e.globalStep)}: ${metricsText(e.metrics)} — by job ${e.evaluationJobId}, checkpoint ${checkpointName(e.checkpointId)}`,
  }));
}

/** `<job>/checkpoint/step-000000040-a1` → `step-000000040-a1`, the id the checkpoints table shows. */
const checkpointName = (artifactId) => String(artifactId).split("/").at(-1);

/**
 * Whether evaluations may still arrive: a READY checkpoint has none yet, while the job may still run or within
 * `EVAL_GRACE_MS` of its end (the last checkpoint's evaluation comes after the job finished).
 */
export function evaluationsPending(view, evaluations, now = Date.now()) {
  const evaluated = new Set(evaluations.map((e) => e.globalStep));
  if (!view.checkpoints?.some((c) => c.state === "READY" && !evaluated.has(c.globalStep))) return false;
  if (!FINISHED.has(view.state)) return true;
  const ended = Date.parse(view.attempts?.at(-1)?.endedAt || view.updatedAt);
  return !(now - ended > EVAL_GRACE_MS);
}

function section(id, title, ...children) {
  return h("section", { class: "card", id, "aria-labelledby": `${id}-h` }, h("h2", { id: `${id}-h` }, title), ...children);
}

function header(view, ctx, refresh) {
  const pr = view.progress || {};
  const max = pr.maxSteps || view.spec.training?.maxSteps;
  const done = max ? Math.min(1, (pr.globalStep || 0) / max) : 0;
  const eta = ["queued", "running"].includes(view.state)
    ? etaSeconds({ state: view.state, maxSteps: max, globalStep: pr.globalStep, createdAt: view.attempts.at(-1)?.startedAt || view.createdAt, updatedAt: pr.updatedAt || view.updatedAt, etaSeconds: view.etaSeconds })
    : null;
  const label = view.name || view.jobId;
  return h("div", { class: "card", id: "job-header" },
    h("h1", {}, label, " ", stateBadge(view.state, "job-state")),
    experimentLine(view.experiment),
    h("div", { class: "grid" },
      h("div", {},
        h("div", { class: "bar", id: "job-progress", role: "progressbar", "aria-valuemin": 0, "aria-valuemax": max, "aria-valuenow": pr.globalStep || 0, "aria-label": "training progress" }, h("span", { style: `width:${(done * 100).toFixed(1)}%` })),
        h("div", { id: "job-step" }, `step ${int(pr.globalStep || 0)} of ${int(max)}`, eta != null ? ` · about ${seconds(eta)} left` : ""),
        view.queuedReason ? h("p", { class: "notice", id: "job-queued-reason" }, `Waiting: ${view.queuedReason}`) : null,
        environmentNotice(view),
        view.reason ? h("p", { class: "muted", id: "job-reason" }, view.reason) : null),
      h("dl", { class: "kv" },
        h("dt", {}, "loss"), h("dd", {}, num(pr.lastLoss, 4)),
        h("dt", {}, "tokens/s"), h("dd", { id: "job-tokens-per-second", "data-value": pr.tokensPerSecond, title: "the attempt's tokens over its step time without checkpoint stalls" }, rate(pr.tokensPerSecond, "tok")),
        h("dt", {}, "MFU"), h("dd", {}, pr.mfu == null ? "—" : pct(pr.mfu)),
        h("dt", {}, "goodput"), h("dd", {}, pct(view.goodput?.goodput))),
      h("div", { class: "actions" },
        ...actionsFor(view.state).map((action) => h("button", {
          type: "button", id: `action-${action}`, "data-action": action, class: action === "cancel" ? "danger" : null,
          onclick: async () => { try { await control(ctx, view.jobId, action, label); await refresh(); } catch (e) { notify(e.message); } },
        }, action[0].toUpperCase() + action.slice(1))),
        h("a", { href: `#/lab?${labQuery(view)}`, id: "open-lab" }, "Open in the Lab"))));
}

/** "Trial 3 of experiment lr-sweep (learning rate 0.003)", linking back, for a job an experiment submitted. */
function experimentLine(origin) {
  if (!origin) return null;
  return h("p", { id: "job-experiment" }, `Trial ${origin.trial} of experiment `,
    h("a", { href: `#/experiments/${origin.experimentId}`, id: "job-experiment-link" }, origin.experimentName),
    h("span", { class: "muted" }, ` (${pointText(origin.params)})`));
}

// Each node's preparation of the job's environment (code.environment), while the latest attempt starts.
function environmentNotice(view) {
  const attempt = view.attempts.at(-1);
  const nodes = Object.entries(attempt?.environment || {});
  if (!nodes.length || !["queued", "running"].includes(view.state) || Object.keys(attempt.starts || {}).length) return null;
  const building = nodes.filter(([, e]) => e.state === "building");
  if (!building.length) return null;
  return h("p", { class: "notice", id: "job-environment" }, "Preparing environment: ",
    ...building.map(([node, e]) => h("span", {}, `${node} building ${e.packages} package(s), ${Math.round(e.elapsedSeconds)}s${e.detail ? ` — ${e.detail}` : ""}. `)));
}

function lineage(view, artifacts) {
  const spec = view.spec;
  const parent = spec.initFrom?.jobId
    ? h("a", { class: "node", href: `#/jobs/${spec.initFrom.jobId}` }, `from ${spec.initFrom.jobId}${spec.initFrom.globalStep != null ? ` @ step ${spec.initFrom.globalStep}` : ""}`)
    : spec.initFrom?.huggingFace ? h("span", { class: "node" }, `from ${spec.initFrom.huggingFace.path || spec.initFrom.huggingFace.uri || "a Hugging Face directory"}`) : null;
  const ready = view.checkpoints.filter((c) => c.state === "READY").length;
  const exports = artifacts.filter((a) => a.type === "export");
  const models = artifacts.filter((a) => a.type === "model");
  const arrow = () => h("span", { class: "arrow", "aria-hidden": "true" }, "→");
  const children = view.children || []; // job ids started from this one (their initFrom.jobId), newest first
  return h("div", {},
    h("div", { class: "lineage", id: "lineage", "aria-label": "lineage" },
      parent, parent ? arrow() : null,
      h("span", { class: "node" }, `dataset ${spec.dataset}`), arrow(),
      h("span", { class: "node" }, `job ${view.jobId}`), arrow(),
      h("span", { class: "node" }, `${view.attempts.length} attempt${view.attempts.length === 1 ? "" : "s"}`), arrow(),
      h("span", { class: "node" }, `${ready} READY checkpoint${ready === 1 ? "" : "s"}`), arrow(),
      h("span", { class: "node" }, `${models.length} model${models.length === 1 ? "" : "s"}, ${exports.length} export${exports.length === 1 ? "" : "s"}`),
      ...children.map((c) => [arrow(), h("a", { class: "node", href: `#/jobs/${c}`, "data-child": c }, `child ${c}`)]).flat()),
    h("details", {}, h("summary", {}, "Spec"), h("pre", {}, JSON.stringify(spec, null, 2))));
}

function attemptsTimeline(view) {
  if (!view.attempts.length) return h("p", { class: "muted", id: "attempts-empty" }, emptyText(view, "No attempt yet.", `No attempt ran: ${endedText(view)}.`));
  const now = Date.now();
  const t0 = Math.min(...view.attempts.map((a) => Date.parse(a.startedAt)));
  const t1 = Math.max(...view.attempts.map((a) => (a.endedAt ? Date.parse(a.endedAt) : now)), t0 + 1000);
  const rows = view.attempts.map((a) => {
    const s = Date.parse(a.startedAt), e = a.endedAt ? Date.parse(a.endedAt) : now;
    const kind = ["succeeded", "running", "failed"].includes(a.state) ? a.state : "other";
    return h("div", { class: "row", "data-attempt": a.attempt },
      h("span", {}, `attempt ${a.attempt}`),
      h("div", { class: "track" }, h("span", { class: `seg seg-${kind}`, style: `left:${((s - t0) / (t1 - t0)) * 100}%;width:${((e - s) / (t1 - t0)) * 100}%`, title: `${a.state}: ${when(a.startedAt)} – ${when(a.endedAt)}` })));
  });
  const table = h("table", {}, h("thead", {}, h("tr", {}, ...["#", "State", "Nodes", "Ranks", "Started", "Ended", "From checkpoint", "Why it ended"].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, ...view.attempts.map((a) => h("tr", {},
      h("td", {}, a.attempt), h("td", {}, stateBadge(a.state)), h("td", {}, a.nodes.join(", ")), h("td", { class: "num" }, a.worldSize),
      h("td", {}, when(a.startedAt)), h("td", {}, when(a.endedAt)),
      h("td", {}, a.startCheckpoint ? `step ${a.startCheckpoint.globalStep ?? a.startCheckpoint.checkpointId ?? ""}` : "—"),
      h("td", {}, a.failureReason || a.interruption || "—")))));
  return h("div", {}, h("div", { class: "timeline", id: "attempts-timeline" }, ...rows), table);
}

function checkpointsTable(view) {
  if (!view.checkpoints.length) return h("p", { class: "muted", id: "checkpoints-empty" }, emptyText(view, "No checkpoint yet.", `No checkpoint was written: ${endedText(view)}.`));
  return h("table", { id: "checkpoints" },
    h("thead", {}, h("tr", {}, ...["Checkpoint", "State", "Step", "Attempt", "Size", "Write time", "Created", "Reason"].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, ...view.checkpoints.map((c) => h("tr", { "data-checkpoint": c.checkpointId },
      h("td", {}, c.checkpointId), h("td", {}, stateBadge(c.state)), h("td", { class: "num" }, int(c.globalStep)), h("td", { class: "num" }, c.attempt),
      h("td", { class: "num" }, c.sizeBytes != null ? bytes(c.sizeBytes) : "—"), h("td", { class: "num" }, seconds(c.writeSeconds)),
      h("td", {}, when(c.createdAt)), h("td", {}, c.reason || "—")))));
}

function goodputBreakdown(view) {
  const g = view.goodput;
  if (!g) return h("p", { class: "muted", id: "goodput-empty" }, emptyText(view, "Nothing allocated yet.", `No device-time was allocated: ${endedText(view)}.`));
  const parts = [{ label: label("productive"), value: g.productiveDeviceSeconds, color: "#5fae7a" },
    { label: label("inFlight"), value: g.inFlightDeviceSeconds, color: "#9ecae1" },
    ...Object.entries(g.wasted || {}).map(([k, v]) => ({ label: label(k), value: v, color: WASTE_COLORS[k] || "#999" }))];
  return h("div", { id: "goodput" },
    h("p", {}, h("span", { class: "big" }, pct(g.goodput)), " of ", seconds(g.allocatedDeviceSeconds), " device-time allocated was productive"),
    stackedBar(parts, g.allocatedDeviceSeconds),
    h("table", {}, h("tbody", {}, ...parts.map((p) => h("tr", {}, h("th", { scope: "row" }, h("span", { class: "swatch", style: `background:${p.color}` }), p.label),
      h("td", { class: "num" }, seconds(p.value)), h("td", { class: "num" }, g.allocatedDeviceSeconds ? pct(p.value / g.allocatedDeviceSeconds) : "—"))))));
}

function curvesSection(jobId, ctx, viewOf, evaluationsOf) {
  const from = h("input", { id: "zoom-from", type: "number", min: 0, step: 1, inputmode: "numeric" });
  const to = h("input", { id: "zoom-to", type: "number", min: 0, step: 1, inputmode: "numeric" });
  const info = h("p", { class: "muted", id: "curves-info", "aria-live": "polite" });
  const grid = h("div", { class: "charts", id: "curves" });
  const zoomForm = h("form", { class: "inline", "aria-label": "Step range" },
    h("label", { for: "zoom-from" }, "From step", from), h("label", { for: "zoom-to" }, "To step", to),
    h("button", { type: "submit", id: "zoom-apply" }, "Zoom"), h("button", { type: "button", id: "zoom-reset" }, "Whole run"));
  let range = null, m = null;
  const draw = () => {
    if (!m) return;
    const series = CURVES.map((name) => [name, m.series[name] || { steps: [], values: [], totalPoints: 0 }]);
    const anyData = series.some(([, sr]) => sr.totalPoints > 0);
    const evaluations = evaluationsOf();
    grid.replaceChildren(...series.map(([name, sr]) => h("figure", { "data-curve": name, "data-total": sr.totalPoints },
      h("figcaption", {}, h("strong", {}, label(name)), h("span", { class: "muted" }, ` ${int(sr.steps.length)} of ${int(sr.totalPoints)} steps`)),
      lineChart({ name, label: label(name), steps: sr.steps, values: sr.values, empty: emptyCurveText(viewOf(), name, anyData),
        markers: name === "loss" ? evaluationMarkers(evaluations) : [],
        onZoom: (a, b) => { from.value = a; to.value = b; range = [a, b]; load(); } }),
      name === "loss" ? evaluationsLegend(evaluations) : null)));
  };
  async function load() {
    const q = new URLSearchParams({ series: CURVES.join(","), maxPoints: String(MAX_POINTS) });
    if (range) { q.set("fromStep", String(range[0])); q.set("toStep", String(range[1])); }
    m = await api(`/v1/training-jobs/${jobId}/metrics?${q}`, { signal: ctx.signal });
    draw();
    info.className = "muted";
    info.textContent = `steps ${int(m.fromStep)}–${int(m.toStep)} · ${m.method === "all" ? "every step" : `down-sampled (${m.method}) to at most ${int(MAX_POINTS)} points`} · drag across a chart to zoom`;
  }
  zoomForm.addEventListener("submit", (e) => { e.preventDefault(); range = from.value && to.value ? [Number(from.value), Number(to.value)] : null; load().catch(showError(info)); });
  zoomForm.querySelector("#zoom-reset").addEventListener("click", () => { range = null; from.value = ""; to.value = ""; load().catch(showError(info)); });
  const fail = (e) => { info.textContent = `The metric history could not be read: ${e.message}`; info.className = "error"; };
  return { el: section("curves-section", "Curves", zoomForm, info, grid), load: () => (range ? Promise.resolve() : load()), fail, redraw: draw };
}

/** Under the loss chart, once there are evaluations: what the markers are, or why there are none. */
function evaluationsLegend(evaluations) {
  if (!evaluations.length) return null;
  const drawn = evaluations.filter((e) => Number.isFinite(e.metrics?.loss)).length;
  const others = evaluations.length - drawn;
  return h("div", { class: "legend", id: "loss-legend" },
    h("span", {}, h("span", { class: "swatch line-swatch" }), "training loss"),
    drawn ? h("span", {}, h("span", { class: "swatch eval-swatch" }), "evaluation (held-out)") : null,
    others ? h("a", { href: "#evaluations-section", id: "loss-legend-others", onclick: jumpTo("evaluations-section") },
      `${others} evaluation${others === 1 ? "" : "s"} without a loss: in the table below`) : null);
}

// the hash routes pages: an in-page anchor scrolls without changing it
const jumpTo = (id) => (e) => { e.preventDefault(); document.getElementById(id)?.scrollIntoView(); };

/**
 * The evaluations of the job's checkpoints (`…/evaluations`): a row per evaluation, step, checkpoint, each metric,
 * the evaluation job; read again every `EVAL_POLL_MS` while more may come (`evaluationsPending`).
 */
function evaluationsSection(jobId, ctx, viewOf, onChange) {
  const holder = h("div", { id: "evaluations" });
  let list = null, timer = null;
  ctx.signal.addEventListener("abort", () => clearTimeout(timer), { once: true });
  const draw = () => {
    const view = viewOf();
    if (!list.length) {
      const text = evaluationsPending(view, list) ? "No evaluation yet: the evaluations of READY checkpoints (a checkpoint trigger's evaluation jobs) appear here."
        : FINISHED.has(view.state) ? "No checkpoint of this job was evaluated." : "No evaluation yet.";
      holder.replaceChildren(h("p", { class: "muted", id: "evaluations-empty" }, text));
      return;
    }
    const names = metricNames(list);
    holder.replaceChildren(h("table", { id: "evaluations-table" },
      h("thead", {}, h("tr", {}, h("th", { scope: "col", class: "num" }, "Step"), h("th", { scope: "col" }, "Checkpoint"),
        ...names.map((k) => h("th", { scope: "col", class: "num" }, label(k))), h("th", { scope: "col" }, "Evaluation job"), h("th", { scope: "col" }, "Finished"))),
      h("tbody", {}, ...list.map((e) => h("tr", { "data-evaluation": e.evaluationJobId, "data-step": e.globalStep },
        h("td", { class: "num" }, int(e.globalStep)), h("td", { title: e.checkpointId }, checkpointName(e.checkpointId)),
        ...names.map((k) => h("td", { class: "num", "data-metric": k }, num(e.metrics[k], 4))),
        h("td", {}, h("a", { href: `#/jobs/${e.evaluationJobId}`, "data-job-link": e.evaluationJobId }, e.evaluationJobId)),
        h("td", {}, when(e.finishedAt)))))));
  };
  const fail = (e) => holder.replaceChildren(h("p", { class: "error" }, `The evaluations could not be read: ${e.message}`));
  async function load() {
    clearTimeout(timer);
    const answer = await api(`/v1/training-jobs/${jobId}/evaluations`, { signal: ctx.signal });
    const changed = JSON.stringify(answer.evaluations) !== JSON.stringify(list);
    list = answer.evaluations;
    draw();
    if (changed) onChange();
    clearTimeout(timer); // a refresh's read and the timer's may overlap: one timer at a time
    if (evaluationsPending(viewOf(), list) && !ctx.signal.aborted) {
      timer = setTimeout(() => load().catch((e) => { if (!ctx.signal.aborted) fail(e); }), EVAL_POLL_MS);
    }
  }
  const el = section("evaluations-section", "Evaluations", holder,
    h("p", { class: "muted" }, "Held-out metrics of the job's READY checkpoints, each by an evaluation job; drawn on the loss chart as ◆."));
  return { el, load, fail, list: () => list || [] };
}

function heatSection(jobId, ctx, stragglersOf, viewOf) {
  const select = h("select", { id: "heat-series" }, ...TIMING.map((v) => h("option", { value: v }, label(v))));
  const holder = h("div", { id: "heatmap" });
  let data = null;
  const draw = () => {
    if (!data) return;
    if (!data.ranks || !Object.keys(data.ranks).length) {
      holder.replaceChildren(h("p", { class: "muted", id: "heatmap-empty" }, emptyText(viewOf(), "No per-rank timing yet.", `No per-rank timing was recorded: ${endedText(viewOf())}.`)));
      return;
    }
    holder.replaceChildren(heatMap({ ranks: data.ranks, series: select.value, stragglers: stragglersOf(), label: `${select.selectedOptions[0].textContent} seconds per rank over steps` }));
  };
  select.addEventListener("change", draw);
  const fail = (e) => holder.replaceChildren(h("p", { class: "error" }, `The per-rank timing could not be read: ${e.message}`));
  async function load() {
    const q = new URLSearchParams({ series: TIMING.join(","), byRank: "true", maxPoints: String(HEAT_BUCKETS) });
    data = await api(`/v1/training-jobs/${jobId}/metrics?${q}`, { signal: ctx.signal });
    draw();
  }
  return { el: section("heat-section", "Time per rank", h("form", { class: "inline", onsubmit: (e) => e.preventDefault() }, h("label", { for: "heat-series" }, "Show", select)), holder, h("p", { class: "muted" }, "One row per rank, one cell per group of steps (the mean); stragglers the platform reported are marked ⚠.")), load, fail, redraw: draw };
}

function logsSection(view, ctx) {
  const attempt = h("select", { id: "log-attempt" });
  const rank = h("select", { id: "log-rank" });
  const follow = h("input", { type: "checkbox", id: "log-follow", checked: true });
  const pre = h("pre", { class: "logs", id: "logs", tabindex: 0, "aria-label": "log lines", "aria-live": "off" });
  let reader = null;
  const fill = (v) => {
    const last = v.attempts.at(-1);
    const prevA = attempt.value;
    attempt.replaceChildren(...v.attempts.map((a) => h("option", { value: a.attempt }, `attempt ${a.attempt} (${a.state})`)));
    attempt.value = prevA || (last ? String(last.attempt) : "");
    const world = (v.attempts.find((a) => String(a.attempt) === attempt.value) || last)?.worldSize || 0;
    const prevR = rank.value;
    rank.replaceChildren(...Array.from({ length: world }, (_, i) => h("option", { value: i }, `rank ${i}`)));
    rank.value = prevR && Number(prevR) < world ? prevR : "0";
  };
  async function load() {
    reader?.abort();
    if (!attempt.value) { pre.textContent = emptyText(current, "No attempt yet.", `No attempt ran, so there is no log: ${endedText(current)}.`); return; }
    reader = new AbortController();
    ctx.signal.addEventListener("abort", () => reader.abort(), { once: true });
    const q = new URLSearchParams({ attempt: attempt.value, rank: rank.value || "0", tail: "200", follow: String(follow.checked) });
    pre.textContent = "";
    const append = (t) => { const stick = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4; pre.append(t); if (stick) pre.scrollTop = pre.scrollHeight; };
    try { await stream(`/v1/training-jobs/${view.jobId}/logs?${q}`, append, reader.signal); }
    catch (e) { if (!reader.signal.aborted) append(`\n[${e.message}]\n`); }
  }
  for (const el of [attempt, rank, follow]) el.addEventListener("change", () => { if (el === attempt) fill(current); load(); });
  let current = view;
  fill(view);
  const form = h("form", { class: "inline", onsubmit: (e) => { e.preventDefault(); load(); } },
    h("label", { for: "log-attempt" }, "Attempt", attempt), h("label", { for: "log-rank" }, "Rank", rank),
    h("label", { class: "check", for: "log-follow" }, follow, "Follow"), h("button", { type: "submit" }, "Reload"));
  return { el: section("logs-section", "Logs", form, pre), load, update: (v) => { const had = attempt.options.length; current = v; fill(v); if (attempt.options.length !== had) { attempt.value = String(v.attempts.at(-1).attempt); load(); } } };
}

const showError = (el) => (e) => { el.textContent = e.message; el.classList.add("error"); };

export async function render(main, { id }, ctx) {
  let view = await api(`/v1/training-jobs/${id}`, { signal: ctx.signal });
  const artifacts = await api(`/v1/registry/artifacts?jobId=${id}`, { signal: ctx.signal }).then((a) => a.artifacts, () => []);
  const head = h("div", {});
  const lin = section("lineage-section", "Spec and lineage");
  const att = section("attempts-section", "Attempts");
  const cks = section("checkpoints-section", "Checkpoints");
  const good = section("goodput-section", "Goodput");
  const stragglers = () => new Set((view.stragglers || []).filter((s) => s.attempt === view.attempts.at(-1)?.attempt).map((s) => s.rank));
  const evals = evaluationsSection(id, ctx, () => view, () => curves.redraw());
  const curves = curvesSection(id, ctx, () => view, evals.list);
  const heat = heatSection(id, ctx, stragglers, () => view);
  const logs = logsSection(view, ctx);
  const paint = () => {
    const focused = document.activeElement?.id; // a keyboard user keeps their place across live updates
    head.replaceChildren(header(view, ctx, refresh));
    lin.replaceChildren(lin.firstChild, lineage(view, artifacts));
    att.replaceChildren(att.firstChild, attemptsTimeline(view));
    cks.replaceChildren(cks.firstChild, checkpointsTable(view));
    good.replaceChildren(good.firstChild, goodputBreakdown(view));
    if (focused && document.activeElement?.id !== focused) document.getElementById(focused)?.focus();
  };
  async function refresh() {
    view = await api(`/v1/training-jobs/${id}`, { signal: ctx.signal });
    paint();
    logs.update(view);
    await loadMetrics();
  }
  // the curves and the heat map say for themselves when their data cannot be read; the rest still updates
  const loadMetrics = () => Promise.all([
    curves.load().catch((e) => { if (!ctx.signal.aborted) curves.fail(e); }),
    heat.load().catch((e) => { if (!ctx.signal.aborted) heat.fail(e); }),
    evals.load().catch((e) => { if (!ctx.signal.aborted) evals.fail(e); }),
  ]);
  paint();
  main.replaceChildren(h("p", {}, h("a", { href: "#/jobs" }, "← Jobs")), head, curves.el, evals.el, heat.el,
    h("div", { class: "grid" }, att, good), cks, logs.el, lin);
  await loadMetrics();
  logs.load();

  // live: each job event (state, progress, attempts, checkpoints) refreshes the page, at most every 1 s
  let pending = null, lastState = view.state;
  const schedule = () => {
    if (pending) return;
    pending = setTimeout(async () => { pending = null; try { await refresh(); } catch (e) { if (!ctx.signal.aborted) console.warn(e.message); } }, 1000);
  };
  ctx.signal.addEventListener("abort", () => clearTimeout(pending), { once: true });
  liveJobs({
    jobId: id, signal: ctx.signal,
    onJob: (j) => { if (j.jobId === id && (j.state !== lastState || j.globalStep !== view.progress?.globalStep || j.attempts !== view.attempts.length || j.updatedAt !== view.updatedAt)) { lastState = j.state; schedule(); } },
    poll: refresh,
  });
}
