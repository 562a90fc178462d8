// The Lab: three experiments on the planner's own numbers (POST /v1/lab/memory, /scaling, /checkpoint, the
// functions `trainyard plan` uses). Every control change asks the API again; the page shows its answer.

import { api } from "./api.js";
import { bytes, h, int, label, num, pct, seconds } from "./format.js";
import { chartLegend, lineChart } from "./charts.js";

/** A model field: a catalog ref (`gpt-1b@v1`), a parameter count (`7e9`), or inline JSON. */
export function modelOf(text) {
  const t = String(text).trim();
  if (/^[0-9.]+(e[0-9]+)?$/i.test(t)) return { parameters: Number(t) };
  if (t.startsWith("{")) return JSON.parse(t);
  return t;
}

function field(id, text, attrs) {
  if (attrs.type === "number" && attrs.required === undefined) attrs = { ...attrs, required: true };
  const input = h(attrs.options ? "select" : "input", { id, name: id, ...attrs, options: null, value: attrs.options ? null : attrs.value },
    ...(attrs.options || []).map((o) => h("option", { value: o, selected: String(o) === String(attrs.value) }, label(o))));
  if (attrs.type === "checkbox") input.checked = !!attrs.value;
  return h("label", { for: id, class: attrs.type === "checkbox" ? "check" : null }, attrs.type === "checkbox" ? input : null, text, attrs.type === "checkbox" ? null : input);
}

function value(form, id) {
  const el = form.querySelector(`#${id}`);
  if (el.type === "checkbox") return el.checked;
  if (el.type === "number" || el.type === "range") return el.value === "" ? null : Number(el.value);
  return el.value;
}

/** Wire a form to an endpoint: each input asks again (the latest answer wins), the result is drawn. */
function experiment({ id, title, intro, fields, endpoint, body, draw, ctx }) {
  const out = h("div", { class: "lab-out", id: `${id}-out`, "aria-live": "polite" });
  const status = h("p", { class: "muted", id: `${id}-status` });
  const form = h("form", { class: "inline", id: `${id}-form`, "aria-label": title }, ...fields.map((f) => field(f.id, f.label, f)));
  let seq = 0, timer = null;
  async function run() {
    const mine = ++seq;
    const invalid = [...form.elements].find((el) => !el.checkValidity());
    if (invalid) {  // half-typed input (an emptied field, a value below its minimum) is not sent to the planner
      status.textContent = `${invalid.labels?.[0]?.firstChild?.textContent?.trim() || invalid.id}: ${invalid.validationMessage}`;
      status.className = "error";
      return;
    }
    let request;
    try { request = body((k) => value(form, k)); } catch (e) { status.textContent = e.message; status.className = "error"; return; }
    try {
      const answer = await api(endpoint, { method: "POST", body: request, signal: ctx.signal });
      if (mine !== seq) return;
      status.textContent = ""; status.className = "muted";
      out.dataset.request = JSON.stringify(request);
      draw(out, answer, request);
      out.dataset.seq = String(mine);
    } catch (e) {
      if (mine !== seq || ctx.signal.aborted) return;
      status.textContent = e.message; status.className = "error";
    }
  }
  form.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(run, 120); });
  form.addEventListener("change", () => { clearTimeout(timer); timer = setTimeout(run, 60); });
  form.addEventListener("submit", (e) => { e.preventDefault(); run(); });
  return { el: h("section", { class: "card", id, "aria-labelledby": `${id}-h` }, h("h2", { id: `${id}-h` }, title), h("p", { class: "muted" }, intro), form, status, out), run };
}

const PER_DEVICE = ["parametersBytes", "gradientsBytes", "optimizerBytes", "activationsBytes", "totalBytes", "capacityBytes", "headroomBytes", "usableBytes", "freeBytes"];

function drawMemory(out, a, request) {
  const d = a.perDevice || {};
  const bpp = a.bytesPerParameter || {};
  const curve = a.curve || [];
  const kinds = curve.length ? Object.keys(curve[0]).filter((k) => k !== "parameters") : [];
  out.replaceChildren(
    h("div", { class: "grid" },
      h("table", { id: "memory-per-device" }, h("caption", {}, "per device"), h("tbody", {}, ...PER_DEVICE.map((k) => h("tr", { "data-field": k }, h("th", { scope: "row" }, label(k)), h("td", { class: "num", "data-bytes": d[k] }, bytes(d[k])))))),
      h("div", {},
        h("table", { id: "memory-bytes-per-parameter" }, h("caption", {}, "bytes per parameter"), h("tbody", {}, ...Object.entries(bpp).map(([k, v]) => h("tr", { "data-field": k }, h("th", { scope: "row" }, label(k)), h("td", { class: "num" }, num(v)))))),
        h("p", { id: "memory-fits", class: d.fits === false ? "error" : "notice" }, d.fits === false ? `Does not fit: ${bytes(-d.freeBytes)} over what one device may use.` : `Fits, with ${bytes(d.freeBytes)} to spare.`),
        h("p", { id: "memory-sharding-needed" }, "Sharding becomes necessary above ", h("strong", { "data-value": a.shardingNeededAbove }, a.shardingNeededAbove == null ? "—" : `${num(a.shardingNeededAbove)} parameters`)))),
    curve.length ? memoryChart(curve, kinds, d, request) : null,
    curve.length ? h("details", {}, h("summary", {}, "The curve as a table"), h("table", { id: "memory-curve" }, h("thead", {}, h("tr", {}, h("th", { class: "num" }, "Parameters"), ...kinds.map((k) => h("th", { class: "num" }, label(k))))),
      h("tbody", {}, ...curve.map((p) => h("tr", {}, h("td", { class: "num" }, num(p.parameters)), ...kinds.map((k) => h("td", { class: "num" }, bytes(p[k])))))))) : null);
}

/** Tick values of a log bytes axis (1 B, 32 B, 1 KiB, 32 KiB, …) and how a tick says them ("32 GiB"). */
const BINARY_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
const BINARY = BINARY_UNITS.flatMap((_, i) => [1024 ** i, 32 * 1024 ** i]);
function bytesTick(v) {
  const i = BINARY_UNITS.findLastIndex((_, k) => v >= 1024 ** k);
  const q = v / 1024 ** Math.max(i, 0);
  return i >= 0 && Number.isInteger(q) ? `${q} ${BINARY_UNITS[i]}` : bytes(v);
}
const compact = new Intl.NumberFormat("en-US", { notation: "compact" });

const SHARDING_COLORS = { ddp: "#2456c7", zero1: "#1f7a3f", zero2: "#9a6200", fsdp: "#8e3fb3" };

function memoryChart(curve, kinds, perDevice, request) {
  const steps = curve.map((p) => p.parameters);
  const usable = perDevice.usableBytes ?? (perDevice.capacityBytes != null ? perDevice.capacityBytes - (perDevice.headroomBytes || 0) : null);
  const [first, ...rest] = kinds;
  return h("figure", {}, h("figcaption", {}, `memory per device vs parameters (both axes logarithmic), ${request.devices} devices`),
    h("div", { class: "charts" }, h("div", {},
      lineChart({ name: "memory", label: "bytes per device by sharding", steps, values: curve.map((p) => p[first]), logX: true, logY: true, format: bytesTick, yValues: BINARY, formatX: (v) => compact.format(v),
        lines: rest.map((k) => ({ name: k, values: curve.map((p) => p[k]), color: SHARDING_COLORS[k] || "#666" })),
        hline: usable != null ? { value: usable, label: `usable ${bytes(usable)}` } : null }),
      chartLegend(kinds.map((k) => ({ label: label(k), color: SHARDING_COLORS[k] || "#666" }))))));
}

function drawScaling(out, a) {
  const pts = a.points || [];
  out.replaceChildren(
    h("p", { id: "scaling-stops" }, "Adding devices stops helping at ", h("strong", { "data-value": a.stopsHelpingAt }, a.stopsHelpingAt == null ? "—" : `${int(a.stopsHelpingAt)} devices`)),
    h("div", { class: "charts" },
      h("figure", {}, h("figcaption", {}, "tokens/s vs devices"), lineChart({ name: "scaling-tokens", label: "tokens per second", steps: pts.map((p) => p.devices), values: pts.map((p) => p.tokensPerSecond) })),
      h("figure", {}, h("figcaption", {}, "communication ÷ compute vs devices"), lineChart({ name: "scaling-ratio", label: "communication to compute", steps: pts.map((p) => p.devices), values: pts.map((p) => p.commToCompute) }))),
    h("table", { id: "scaling-points" }, h("thead", {}, h("tr", {}, ...["devices", "step", "compute", "communication", "comm ÷ compute", "tokens/s", "efficiency"].map((t) => h("th", { class: "num", scope: "col" }, t)))),
      h("tbody", {}, ...pts.map((p) => h("tr", { "data-devices": p.devices },
        h("td", { class: "num" }, int(p.devices)), h("td", { class: "num", "data-value": p.stepSeconds }, seconds(p.stepSeconds)), h("td", { class: "num" }, seconds(p.computeSeconds)),
        h("td", { class: "num" }, seconds(p.communicationSeconds)), h("td", { class: "num" }, num(p.commToCompute)), h("td", { class: "num" }, num(p.tokensPerSecond)), h("td", { class: "num" }, pct(p.efficiency)))))));
}

/** Round durations for a log time axis, and how a tick says them ("10 min", not "10 min 0 s"). */
const DURATIONS = [1, 10, 60, 600, 3600, 6 * 3600, 86400, 7 * 86400];
const UNIT_SECONDS = [[86400, "d"], [3600, "h"], [60, "min"], [1, "s"]];
function durationTick(v) {
  const [unit, name] = UNIT_SECONDS.find(([u]) => v >= u && Number.isInteger(v / u)) || [];
  return unit ? `${v / unit} ${name}` : seconds(v);
}

function drawCheckpoint(out, a) {
  const c = a.curve || [];
  out.replaceChildren(
    h("p", { id: "checkpoint-optimum" }, "Young/Daly optimum: checkpoint every ", h("strong", { "data-value": a.optimumSeconds }, seconds(a.optimumSeconds))),
    h("div", { class: "charts" }, h("figure", {}, h("figcaption", {}, "expected waste vs checkpoint interval"),
      lineChart({ name: "checkpoint-waste", label: "wasted fraction", steps: c.map((p) => p.intervalSeconds), values: c.map((p) => p.wasteFraction), format: (v) => pct(v), formatX: durationTick, xValues: DURATIONS, logX: true,
        lines: [{ name: "redo", values: c.map((p) => p.redoFraction), color: "#e07b73" }, { name: "overhead", values: c.map((p) => p.overheadFraction), color: "#e8b04a" }] }),
      chartLegend([{ label: "waste", color: "#2456c7" }, { label: "redo", color: "#e07b73" }, { label: "overhead (writing)", color: "#e8b04a" }]))),
    h("table", { id: "checkpoint-curve" }, h("thead", {}, h("tr", {}, ...["interval", "redo", "overhead", "waste"].map((t) => h("th", { class: "num", scope: "col" }, t)))),
      h("tbody", {}, ...c.filter((_, i) => c.length <= 12 || i % Math.ceil(c.length / 12) === 0).map((p) => h("tr", {},
        h("td", { class: "num" }, seconds(p.intervalSeconds)), h("td", { class: "num" }, pct(p.redoFraction)), h("td", { class: "num" }, pct(p.overheadFraction)), h("td", { class: "num" }, pct(p.wasteFraction)))))));
}

export async function render(main, { query }, ctx) {
  const q = (k, d) => query.get(k) ?? d;
  const fromJob = query.has("model");
  const device = q("device", "h100-80gb");
  const memory = experiment({
    ctx, id: "lab-memory", title: "1 · Model size vs memory per device", endpoint: "/v1/lab/memory",
    intro: "16 bytes per parameter with mixed-precision Adam (weights, gradients, fp32 master and two moments), plus activations. Change the model or how it is sharded and see where it stops fitting.",
    fields: [
      { id: "mem-model", label: "Model (catalog ref or parameters)", value: q("model", "7e9"), type: "text" },
      { id: "mem-devices", label: "Devices", type: "number", min: 1, value: q("devices", "8") },
      { id: "mem-sharding", label: "Sharding", options: ["ddp", "zero1", "zero2", "fsdp"], value: q("sharding", "ddp") },
      { id: "mem-micro", label: "Micro-batch", type: "number", min: 1, value: q("microBatch", "1") },
      { id: "mem-seq", label: "Sequence length", type: "number", min: 1, value: q("sequenceLength", "2048") },
      { id: "mem-recompute", label: "Activation recomputation", options: ["none", "selective", "full"], value: q("recompute", "none") },
      { id: "mem-device", label: "Device type", type: "text", value: device },
    ],
    body: (v) => ({ model: modelOf(v("mem-model")), devices: v("mem-devices"), sharding: v("mem-sharding"), microBatch: v("mem-micro"), sequenceLength: v("mem-seq"), recompute: v("mem-recompute"), device: v("mem-device") }),
    draw: drawMemory,
  });
  const scaling = experiment({
    ctx, id: "lab-scaling", title: "2 · GPUs across nodes", endpoint: "/v1/lab/scaling",
    intro: "Add nodes, lower the interconnect: watch communication overtake compute and the point where adding devices stops helping.",
    fields: [
      { id: "scale-model", label: "Model", type: "text", value: q("model", "gpt-1b@v1") },
      { id: "scale-per-node", label: "Devices per node", type: "number", min: 1, value: q("devicesPerNode", "8") },
      { id: "scale-nodes", label: "Up to nodes", type: "number", min: 1, value: q("nodes", "16") },
      { id: "scale-inter", label: "Interconnect GB/s", type: "range", min: 1, max: 400, step: 1, value: q("interconnectGBps", "50") },
      { id: "scale-intra", label: "Intra-node GB/s", type: "number", min: 1, value: q("intraNodeGBps", "450") },
      { id: "scale-batch", label: "Global batch (sequences)", type: "number", min: 1, value: q("globalBatch", "512") },
      { id: "scale-device", label: "Device type", type: "text", value: device },
    ],
    body: (v) => ({
      model: modelOf(v("scale-model")), devicesPerNode: v("scale-per-node"), nodes: v("scale-nodes"), interconnectGBps: v("scale-inter"),
      intraNodeGBps: v("scale-intra"), globalBatch: v("scale-batch"), device: v("scale-device"),
      // opened from a job: its measured step calibrates the compute efficiency
      ...(query.has("stepSeconds") && query.has("measuredNodes") ? { measured: { nodes: Number(query.get("measuredNodes")), stepSeconds: Number(query.get("stepSeconds")) } } : {}),
    }),
    draw: drawScaling,
  });
  const interBox = scaling.el.querySelector("#scale-inter");
  const interShown = h("output", { for: "scale-inter", id: "scale-inter-value" }, `${interBox.value} GB/s`);
  interBox.after(interShown);
  interBox.addEventListener("input", () => { interShown.textContent = `${interBox.value} GB/s`; });
  const checkpoint = experiment({
    ctx, id: "lab-checkpoint", title: "3 · Checkpoint interval", endpoint: "/v1/lab/checkpoint",
    intro: "Checkpoint more often and redo less after a failure, but spend more time writing: the Young/Daly interval balances the two.",
    fields: [
      { id: "ckpt-mtbf", label: "MTBF (hours)", type: "number", min: 0.01, step: "any", value: q("mtbfHours", "24") },
      { id: "ckpt-write", label: "Write time (s)", type: "number", min: 0, step: "any", value: q("writeSeconds", "60") },
      { id: "ckpt-restart", label: "Restart time (s)", type: "number", min: 0, step: "any", value: q("restartSeconds", "120") },
      { id: "ckpt-step", label: "Step time (s)", type: "number", min: 0, step: "any", value: q("stepSeconds", "1") },
    ],
    body: (v) => ({ mtbfHours: v("ckpt-mtbf"), writeSeconds: v("ckpt-write"), restartSeconds: v("ckpt-restart"), stepSeconds: v("ckpt-step") }),
    draw: drawCheckpoint,
  });
  main.replaceChildren(...[h("h1", {}, "The Lab"),
    fromJob ? h("p", { class: "notice", id: "lab-from-job" }, "Filled in from the job: its model, layout and measured step and checkpoint times.") : null,
    memory.el, scaling.el, checkpoint.el].filter(Boolean));
  await Promise.all([memory.run(), scaling.run(), checkpoint.run()]);
}
