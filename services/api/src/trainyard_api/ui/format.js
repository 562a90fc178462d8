// Numbers and times for people: units, thousands separators, short durations.

const nf = new Intl.NumberFormat("en-US");

export function int(n) { return n == null || Number.isNaN(n) ? "—" : nf.format(Math.round(n)); }

export function num(n, digits = 3) {
  if (n == null || Number.isNaN(n)) return "—";
  const a = Math.abs(n);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return n.toExponential(2);
  return new Intl.NumberFormat("en-US", { maximumSignificantDigits: digits }).format(n);
}

export function pct(f, digits = 1) { return f == null || Number.isNaN(f) ? "—" : `${(f * 100).toFixed(digits)} %`; }

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
export function bytes(b) {
  if (b == null) return "—";
  let i = 0, v = Math.abs(b);
  while (v >= 1024 && i < UNITS.length - 1) { v /= 1024; i++; }
  return `${b < 0 ? "−" : ""}${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${UNITS[i]}`;
}

export function seconds(s) {
  if (s == null || Number.isNaN(s)) return "—";
  if (s === 0) return "0 s";
  if (s < 1) return `${(s * 1000).toFixed(s < 0.01 ? 2 : 0)} ms`;
  if (s < 60) return `${s.toFixed(s < 10 ? 2 : 1)} s`;
  if (s < 3600) { const t = Math.round(s); return t < 3600 ? `${Math.floor(t / 60)} min ${t % 60} s` : "1 h 0 min"; }
  if (s < 86400) { const m = Math.round(s / 60); return m < 1440 ? `${Math.floor(m / 60)} h ${m % 60} min` : "1.0 days"; }
  return `${(s / 86400).toFixed(1)} days`;
}

/**
 * The one table of what the pages call the API's field names: rows and legends say these, never `lostWork`.
 * A name missing here is still shown in words (see `label`).
 */
export const LABELS = {
  // goodput: where device-time went
  productive: "Productive", inFlight: "In flight", lostWork: "Lost work", launchRestore: "Launch and restore",
  checkpointStall: "Checkpoint stalls", hang: "Hangs", replicaDown: "Replicas down (replaced while the others trained)",
  idle: "Idle",
  // the Lab: bytes per parameter and memory per device
  weights: "Weights", gradients: "Gradients", masterWeights: "Master weights (fp32)", optimizerStates: "Optimizer states (Adam's moments)",
  optimizer: "Optimizer, all (master weights and moments)", total: "Total",
  parametersBytes: "Parameters", gradientsBytes: "Gradients", optimizerBytes: "Optimizer states", activationsBytes: "Activations",
  totalBytes: "Total", capacityBytes: "Device memory", headroomBytes: "Headroom (kept free)", usableBytes: "Usable", freeBytes: "Left over",
  ddp: "DDP", zero1: "ZeRO-1", zero2: "ZeRO-2", fsdp: "FSDP",
  // metric series
  loss: "Loss", lr: "Learning rate", tokensPerSecond: "Tokens/s", mfu: "MFU", stepSeconds: "Step",
  computeSeconds: "Compute", collectiveSeconds: "Collective", dataWaitSeconds: "Data wait", checkpointSeconds: "Checkpoint",
  // experiments: search algorithms
  grid: "Grid", random: "Random", tpe: "TPE (optuna)",
};

/** What a page calls the field `key`: the table's words, else the name split into words (`fooBar` → "Foo bar"). */
export function label(key) {
  if (Object.hasOwn(LABELS, key)) return LABELS[key];
  const words = String(key).replace(/([a-z0-9])([A-Z])/g, "$1 $2").replace(/([A-Za-z])([0-9])/g, "$1 $2");
  return words === key ? key : words[0].toUpperCase() + words.slice(1).toLowerCase();
}

export function rate(perSecond, unit) { return perSecond == null ? "—" : `${num(perSecond, 3)} ${unit}/s`; }

export function when(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  return d.toLocaleString("en-GB", { year: "numeric", month: "short", day: "2-digit", hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

/** Build an element: `h("td", {class: "num"}, "12")`; children are strings or nodes. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "style") el.setAttribute("style", v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c != null && c !== false) el.append(c instanceof Node ? c : String(c));
  return el;
}

export function stateBadge(state, id) { return h("span", { class: `state state-${state}`, id }, state); }

/** Say something went wrong (an action refused, a request failed) without leaving the page. */
export function notify(message) {
  const box = document.getElementById("notice");
  box.replaceChildren(h("span", {}, message), h("button", { type: "button", class: "link", "aria-label": "dismiss", onclick: () => { box.hidden = true; } }, "×"));
  box.hidden = false;
}
