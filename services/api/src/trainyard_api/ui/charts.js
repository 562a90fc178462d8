// Charts drawn with SVG and tables: no library, nothing to download. The line chart draws exactly the points
// it is given (the API already down-sampled them, shape-preserving), and reports a dragged step range so the
// page can ask the API for that range in full detail.

import { h, num } from "./format.js";

const SVG = "http://www.w3.org/2000/svg";
function s(tag, attrs = {}) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) if (v != null) el.setAttribute(k, v);
  return el;
}

function extent(values) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) if (Number.isFinite(v)) { if (v < lo) lo = v; if (v > hi) hi = v; }
  if (lo === Infinity) return [0, 1];
  if (lo === hi) return [lo - (Math.abs(lo) || 1) * 0.05, hi + (Math.abs(hi) || 1) * 0.05];
  return [lo, hi];
}

const clean = (v) => Number(v.toPrecision(12)); // 0.1 * 3 is 0.30000000000000004

/** A tick's number with exactly the digits its step needs: every multiple of the step reads differently. */
export function tickNumber(v, step) {
  if (step == null || !(step > 0)) return num(v);
  if (v === 0) return "0";
  const a = Math.abs(v), e = Math.floor(Math.log10(step) + 1e-9); // step = m × 10^e
  if (a >= 1e6 || e < -4) return v.toExponential(Math.max(0, Math.floor(Math.log10(a) + 1e-9) - e));
  const digits = Math.max(0, -e);
  return new Intl.NumberFormat("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits }).format(v);
}

/** Steps of 1, 2 and 5 × 10^k from span / (count + 1) up, or the given ones (`steps`) that are at least that. */
function* stepCandidates(span, count, steps, integer) {
  const least = Math.max(span / (count + 1), integer ? 1 : 0);
  if (steps) yield* steps.filter((st) => st >= least);
  let e = Math.floor(Math.log10(least || 1));
  for (;;) {
    for (const m of [1, 2, 5]) { const st = clean(m * 10 ** e); if (st >= least && !(steps && st <= steps.at(-1))) yield st; }
    e++;
  }
}

/**
 * Ticks of a linear axis over [lo, hi]: multiples of the finest step (1, 2, 5 × 10^k, or `steps`) that gives at
 * most `count` + 1 ticks whose labels (`format(value, step)`) all differ — a step whose labels would round to
 * the same text is passed over for a coarser one. With `nice` the range grows to whole steps (the returned
 * `lo`, `hi`). A range no labelled step fits in gets one tick, at its middle.
 */
export function axisTicks(lo, hi, { count = 5, steps = null, integer = false, nice = false, format = tickNumber } = {}) {
  const one = (v) => ({ lo, hi, ticks: [{ value: v, label: format(v, null) }] });
  if (!(hi > lo) || !Number.isFinite(hi - lo)) return one(lo);
  for (const step of stepCandidates(hi - lo, count, steps, integer)) {
    if (step > hi - lo) break;
    const a = nice ? Math.floor(lo / step + 1e-9) : Math.ceil(lo / step - 1e-9);
    const b = nice ? Math.ceil(hi / step - 1e-9) : Math.floor(hi / step + 1e-9);
    const ticks = [];
    for (let k = a; k <= b; k++) { const value = clean(k * step); ticks.push({ value, label: format(value, step) }); }
    if (ticks.length <= count + 1 && new Set(ticks.map((t) => t.label)).size === ticks.length) return { lo: nice ? ticks[0].value : lo, hi: nice ? ticks.at(-1).value : hi, ticks };
  }
  return one(clean((lo + hi) / 2));
}

/**
 * Ticks of a logarithmic axis over [lo, hi] (values, not logarithms): 1, 2, 5 × 10^k, else 1 and 3, else the
 * decades, else every other decade…, or the given `values`; the densest with at most `count` + 1 distinct labels.
 * A range inside one decade falls back to linear ticks (placed on the log axis all the same).
 */
export function logTicks(lo, hi, { count = 5, values = null, format = tickNumber } = {}) {
  const decades = (ms) => {
    const out = [];
    for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) for (const m of ms) out.push(clean(m * 10 ** e));
    return out;
  };
  const inside = (vs) => vs.filter((v) => v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9));
  const sets = values ? [inside(values)] : [[1, 2, 5], [1, 3], [1]].map((ms) => inside(decades(ms)));
  const last = sets.at(-1);
  for (let every = 2; every < last.length; every++) sets.push(last.filter((_, i) => i % every === 0));
  for (const set of sets) {
    if (set.length < 2 || set.length > count + 1) continue;
    const ticks = set.map((value) => ({ value, label: format(value, value) }));
    if (new Set(ticks.map((t) => t.label)).size === ticks.length) return { lo, hi, ticks };
  }
  return axisTicks(lo, hi, { count, format });
}

/** Steps of a time axis (milliseconds): whole seconds, minutes, hours, days. */
export const TIME_STEPS_MS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800].map((s) => s * 1000);

/**
 * A line chart of `steps` → `values` in an <svg>; `onZoom(fromStep, toStep)` when the user drags a range.
 * `data-points` on the first polyline says how many points it draws. `lines` adds more series over the same
 * x values (`[{name, values, color}]`), `hline` a horizontal reference (`{value, label}`), `logX` a log axis.
 * `format` / `formatX` write a tick (`(value, step)`), `xSteps` the x axis's tick steps (e.g. TIME_STEPS_MS),
 * `xValues` / `yValues` a log axis's tick values; `empty` is what a chart without points says. `markers` are
 * points of another series over the same axes (`[{key, step, value, title, href}]`, e.g. evaluations): each a
 * diamond (`<a class="marker" data-marker=key>` linking to `href`, `title` its tooltip); those outside the
 * curve's steps are left out, and `data-markers` on the <svg> says how many are drawn.
 */
export function lineChart({ name, label, steps, values, onZoom, format = tickNumber, formatX, xSteps = null, xValues = null, yValues = null, lines = [], hline = null, logX = false, logY = false, empty = "no data yet", markers = [] }) {
  const W = 600, H = 200, L = 56, R = 10, T = 10, B = 24;
  const svg = s("svg", { class: "chart", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${label}: ${steps.length} points`, "data-series": name });
  if (!steps.length) {
    const t = s("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }); t.textContent = empty; svg.append(t);
    return svg;
  }
  const fx = logX ? Math.log10 : (v) => v;
  const [x0, x1] = steps.length > 1 ? [fx(steps[0]), fx(steps[steps.length - 1])] : [fx(steps[0]) - 1, fx(steps[0]) + 1];
  const fy = logY ? (v) => (v > 0 ? Math.log10(v) : NaN) : (v) => v;
  const shownMarkers = markers.filter((m) => Number.isFinite(fy(m.value)) && fx(m.step) >= x0 && fx(m.step) <= x1);
  const [y0, y1] = extent([...values, ...lines.flatMap((l) => l.values), ...(hline ? [hline.value] : []), ...shownMarkers.map((m) => m.value)].map(fy));
  const yTicks = logY ? logTicks(10 ** y0, 10 ** y1, { values: yValues, format }) : axisTicks(y0, y1, { format });
  const xFormat = formatX || tickNumber;
  const xTicks = logX ? logTicks(10 ** x0, 10 ** x1, { count: 4, values: xValues, format: xFormat })
    : axisTicks(x0, x1, { count: formatX ? 4 : 5, steps: xSteps, integer: !formatX, format: xFormat });
  const x = (v) => L + ((fx(v) - x0) / (x1 - x0 || 1)) * (W - L - R);
  const yt = (u) => T + (1 - (u - y0) / (y1 - y0 || 1)) * (H - T - B);
  const y = (v) => yt(fy(v));
  const text = (attrs, content) => { const t = s("text", attrs); t.textContent = content; svg.append(t); };
  for (const { value, label: tick } of yTicks.ticks) {
    svg.append(s("line", { class: "grid", x1: L, x2: W - R, y1: y(value), y2: y(value) }));
    text({ x: L - 4, y: y(value) + 4, "text-anchor": "end", class: "tick-y" }, tick);
  }
  for (const { value, label: tick } of xTicks.ticks) {
    const px = x(value);
    text({ x: px, y: H - 6, "text-anchor": px - L < 30 ? "start" : W - R - px < 30 ? "end" : "middle", class: "tick-x" }, tick);
  }
  svg.append(s("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }), s("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  if (hline && Number.isFinite(hline.value)) {
    svg.append(s("line", { x1: L, x2: W - R, y1: y(hline.value), y2: y(hline.value), stroke: "#b3261e", "stroke-dasharray": "4 3" }));
    text({ x: W - R - 2, y: y(hline.value) - 4, "text-anchor": "end" }, hline.label);
  }
  const polyline = (vals, attrs) => {
    const pts = [];
    for (let i = 0; i < steps.length; i++) if (Number.isFinite(fy(vals[i]))) pts.push(`${x(steps[i]).toFixed(1)},${y(vals[i]).toFixed(1)}`);
    svg.append(s("polyline", { points: pts.join(" "), "data-points": pts.length, ...attrs }));
  };
  polyline(values, {});
  for (const l of lines) polyline(l.values, { style: `stroke:${l.color}`, "data-line": l.name });
  if (markers.length) drawMarkers(svg, shownMarkers, x, y);
  if (onZoom) dragToZoom(svg, { W, L, R, x0, x1, onZoom });
  return svg;
}

/** The markers of `lineChart`: a diamond each, a link when it has `href`; a press on one opens it, not a zoom. */
function drawMarkers(svg, markers, x, y) {
  svg.setAttribute("data-markers", markers.length);
  for (const m of markers) {
    const cx = x(m.step), cy = y(m.value), r = 5;
    const mark = s(m.href ? "a" : "g", { class: "marker", href: m.href, "data-marker": m.key, "data-step": m.step, "data-value": m.value, "aria-label": m.title });
    mark.append(s("path", { d: `M${cx.toFixed(1)},${(cy - r).toFixed(1)}l${r},${r}l${-r},${r}l${-r},${-r}z` }));
    const tip = s("title"); tip.textContent = m.title || ""; mark.append(tip);
    mark.addEventListener("pointerdown", (e) => e.stopPropagation()); // the chart's drag-to-zoom would capture the click
    svg.append(mark);
  }
}

/** A legend for a chart's lines. */
export function chartLegend(items) {
  return h("div", { class: "legend" }, ...items.map((i) => h("span", {}, h("span", { class: "swatch", style: `background:${i.color}` }), i.label)));
}

function dragToZoom(svg, { W, L, R, x0, x1, onZoom }) {
  const sel = s("rect", { class: "sel", y: 0, height: "100%", width: 0, visibility: "hidden" });
  svg.append(sel);
  const stepAt = (evt) => {
    const box = svg.getBoundingClientRect();
    const px = ((evt.clientX - box.left) / box.width) * W;
    return x0 + ((Math.min(Math.max(px, L), W - R) - L) / (W - L - R)) * (x1 - x0);
  };
  const toX = (step) => L + ((step - x0) / (x1 - x0 || 1)) * (W - L - R);
  let start = null;
  svg.addEventListener("pointerdown", (e) => { start = stepAt(e); svg.setPointerCapture(e.pointerId); });
  svg.addEventListener("pointermove", (e) => {
    if (start == null) return;
    const a = toX(Math.min(start, stepAt(e))), b = toX(Math.max(start, stepAt(e)));
    sel.setAttribute("x", a); sel.setAttribute("width", Math.max(b - a, 0)); sel.setAttribute("visibility", "visible");
  });
  svg.addEventListener("pointerup", (e) => {
    if (start == null) return;
    const a = Math.round(Math.min(start, stepAt(e))), b = Math.round(Math.max(start, stepAt(e)));
    start = null; sel.setAttribute("visibility", "hidden");
    if (b - a >= 2) onZoom(a, b);
  });
}

const HEAT = ["#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b"];

/**
 * A heat map: a row per rank (`<tr data-rank>`), a cell per step bucket, darker = more seconds.
 * `stragglers` is a Set of ranks to mark.
 */
export function heatMap({ ranks, series, stragglers = new Set(), label }) {
  const ids = Object.keys(ranks).sort((a, b) => Number(a) - Number(b));
  let hi = 0;
  for (const r of ids) for (const v of ranks[r][series]?.values || []) if (Number.isFinite(v) && v > hi) hi = v;
  const table = h("table", { class: "heatmap", "aria-label": label, "data-series": series });
  const body = h("tbody");
  for (const r of ids) {
    const { steps = [], values = [] } = ranks[r][series] || {};
    const slow = stragglers.has(Number(r));
    const row = h("tr", { "data-rank": r, class: slow ? "straggler" : null },
      h("th", { scope: "row" }, `rank ${r}`, slow ? " ⚠ straggler" : ""));
    values.forEach((v, i) => {
      const level = hi > 0 && Number.isFinite(v) ? Math.min(HEAT.length - 1, Math.floor((v / hi) * (HEAT.length - 1) + 0.5)) : 0;
      row.append(h("td", { style: `background:${HEAT[level]}`, title: `rank ${r}, step ${steps[i]}: ${num(v)} s` }));
    });
    body.append(row);
  }
  table.append(body);
  const legend = h("div", { class: "legend" }, "0 s",
    ...HEAT.map((c) => h("span", { class: "swatch", style: `background:${c}` })), `${num(hi)} s`);
  return h("div", { class: "heatmap-wrap" }, table, legend);
}

/** A horizontal stacked bar of named parts (`[{label, value, color}]`). */
export function stackedBar(parts, total) {
  const sum = total || parts.reduce((a, p) => a + (p.value || 0), 0) || 1;
  return h("div", { class: "stack", role: "img", "aria-label": parts.map((p) => `${p.label} ${((100 * (p.value || 0)) / sum).toFixed(1)} %`).join(", ") },
    ...parts.filter((p) => p.value > 0).map((p) => h("span", { style: `width:${(100 * p.value) / sum}%;background:${p.color}`, title: `${p.label}: ${((100 * p.value) / sum).toFixed(1)} %` })));
}

/** The ticks of one axis over [lo, hi]: logarithmic with `log`, else linear (`integer` for whole numbers). */
function ticksOf(lo, hi, { log = false, count = 5, integer = false, format = tickNumber } = {}) {
  return log ? logTicks(lo, hi, { count, format }) : axisTicks(lo, hi, { count, integer, format });
}

/** Whether `v` can be placed on an axis of `opts` (one of its categories, else a finite number). */
const placeable = (v, opts) => (opts.categories ? opts.categories.some((c) => String(c) === String(v)) : Number.isFinite(v) && !(opts.log && v <= 0));

/** An axis's scale from values: numbers (`log`, `integer`) or categories (their order as given, evenly spaced). */
export function axisScale(values, { log = false, integer = false, categories = null } = {}) {
  if (categories) {
    const index = new Map(categories.map((c, i) => [String(c), i]));
    const n = Math.max(categories.length - 1, 1);
    return { at: (v) => (index.has(String(v)) ? (categories.length === 1 ? 0.5 : index.get(String(v)) / n) : NaN), ticks: categories.map((c, i) => ({ value: c, label: String(c), at: categories.length === 1 ? 0.5 : i / n })) };
  }
  const f = log ? (v) => (v > 0 ? Math.log10(v) : NaN) : (v) => v;
  const [u0, u1] = extent(values.map(f));
  const lo = log ? 10 ** u0 : u0, hi = log ? 10 ** u1 : u1;
  const at = (v) => (f(v) - u0) / (u1 - u0 || 1);
  return { at, ticks: ticksOf(lo, hi, { log, integer }).ticks.map((t) => ({ ...t, at: at(t.value) })) };
}

/**
 * A scatter plot: `points` `[{x, y, color, key, state, best, title}]` in an <svg>, one <circle class="point">
 * per point with finite coordinates (`data-key`, `data-state`; `data-best` and a ring on the best). `x` is a
 * scale option object for `axisScale` (`{log, integer, categories}`); `xTitle` / `yTitle` name the axes.
 */
export function scatterPlot({ name, label, points, x: xOpts = {}, xTitle, yTitle, empty = "no trial has a value yet" }) {
  const W = 600, H = 240, L = 56, R = 14, T = 12, B = 40;
  const shown = points.filter((p) => Number.isFinite(p.y) && placeable(p.x, xOpts));
  const svg = s("svg", { class: "chart scatter", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${label}: ${shown.length} points`, "data-scatter": name, "data-points": shown.length });
  const text = (attrs, content) => { const t = s("text", attrs); t.textContent = content; svg.append(t); };
  if (!shown.length) { text({ x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, empty); return svg; }
  const xs = axisScale(shown.map((p) => p.x), xOpts), ys = axisScale(shown.map((p) => p.y));
  const pad = 8; // keep points off the axes
  const px = (v) => L + pad + xs.at(v) * (W - L - R - 2 * pad), py = (v) => T + pad + (1 - ys.at(v)) * (H - T - B - 2 * pad);
  for (const t of ys.ticks) {
    svg.append(s("line", { class: "grid", x1: L, x2: W - R, y1: py(t.value), y2: py(t.value) }));
    text({ x: L - 4, y: py(t.value) + 4, "text-anchor": "end", class: "tick-y" }, t.label);
  }
  for (const t of xs.ticks) text({ x: px(t.value), y: H - B + 14, "text-anchor": "middle", class: "tick-x" }, t.label);
  svg.append(s("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }), s("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  if (xTitle) text({ x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", class: "axis-title" }, xTitle);
  if (yTitle) { const t = s("text", { x: 12, y: (T + H - B) / 2, "text-anchor": "middle", class: "axis-title", transform: `rotate(-90 12 ${(T + H - B) / 2})` }); t.textContent = yTitle; svg.append(t); }
  for (const p of [...shown.filter((q) => !q.best), ...shown.filter((q) => q.best)]) { // the best on top
    const cx = px(p.x).toFixed(1), cy = py(p.y).toFixed(1);
    if (p.best) svg.append(s("circle", { class: "best-ring", cx, cy, r: 9 }));
    const c = s("circle", { class: "point", cx, cy, r: 5, fill: p.color, "data-key": p.key, "data-state": p.state, "data-best": p.best ? "true" : null });
    const tip = s("title"); tip.textContent = p.title || ""; c.append(tip);
    svg.append(c);
  }
  return svg;
}

/**
 * Parallel coordinates: one vertical axis per dimension (`axes` `[{key, title, log, integer, categories}]`),
 * one <polyline class="line"> per row of `rows` `[{values: {key: v}, color, key, state, best, title}]` that has
 * every dimension; the best drawn thicker and last.
 */
export function parallelCoordinates({ name, label, axes, rows, empty = "no trial has a value yet" }) {
  const W = 900, H = 260, L = 60, R = 60, T = 26, B = 6;
  const full = rows.filter((r) => axes.every((a) => placeable(r.values[a.key], a)));
  const svg = s("svg", { class: "chart parallel", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `${label}: ${full.length} trials`, "data-parallel": name, "data-lines": full.length });
  const text = (attrs, content) => { const t = s("text", attrs); t.textContent = content; svg.append(t); };
  if (!full.length) { text({ x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, empty); return svg; }
  const gap = (W - L - R) / Math.max(axes.length - 1, 1);
  const scales = axes.map((a) => axisScale(full.map((r) => r.values[a.key]), a));
  const pad = 8, py = (u) => T + pad + (1 - u) * (H - T - B - 2 * pad);
  for (const r of [...full.filter((q) => !q.best), ...full.filter((q) => q.best)]) { // lines under the axes' labels
    const pts = axes.map((a, i) => `${(L + i * gap).toFixed(1)},${py(scales[i].at(r.values[a.key])).toFixed(1)}`).join(" ");
    const line = s("polyline", { class: r.best ? "line best" : "line", points: pts, style: `stroke:${r.color}`, "data-key": r.key, "data-state": r.state, "data-best": r.best ? "true" : null });
    const tip = s("title"); tip.textContent = r.title || ""; line.append(tip);
    svg.append(line);
  }
  axes.forEach((a, i) => {
    const x = L + i * gap;
    svg.append(s("line", { class: "axis", x1: x, x2: x, y1: T, y2: H - B }));
    text({ x, y: T - 10, "text-anchor": "middle", class: "axis-title" }, a.title);
    const ticks = scales[i].ticks;
    for (const t of ticks.length > 6 ? [ticks[0], ticks.at(-1)] : ticks) text({ x: x - 5, y: py(t.at) + 4, "text-anchor": "end", class: "tick-y halo" }, t.label);
  });
  return svg;
}
