// Cluster and queue (everyone), topology racks → NVLink domains → nodes → devices (platform-admin);
// goodput per tenant, and over time (GET /v1/goodput/history).

import { api, liveJobs } from "./api.js";
import { h, int, label, num, pct, seconds, stateBadge, when } from "./format.js";
import { lineChart, stackedBar, TIME_STEPS_MS } from "./charts.js";

const isAdmin = (me) => me.role === "platform-admin";

function capacityTable(capacity) {
  return h("table", { id: "capacity" },
    h("thead", {}, h("tr", {}, ...["Device type", "Total", "Free", "Held", "Quarantined", "Draining", "Use"].map((t, i) => h("th", { scope: "col", class: i ? "num" : null }, t)))),
    h("tbody", {}, ...capacity.map((c) => h("tr", { "data-device-type": c.deviceType },
      h("th", { scope: "row" }, c.deviceType), ...[c.total, c.free, c.held, c.quarantined, c.draining].map((v) => h("td", { class: "num" }, int(v))),
      h("td", {}, stackedBar([{ label: "held", value: c.held, color: "#6f95e8" }, { label: "quarantined", value: c.quarantined, color: "#e07b73" }, { label: "draining", value: c.draining, color: "#e8b04a" }, { label: "free", value: c.free, color: "#cfe8d6" }], c.total))))));
}

function queueTable(queue) {
  if (!queue.length) return h("p", { class: "muted", id: "queue" }, "Nothing is waiting.");
  return h("table", { id: "queue" },
    h("thead", {}, h("tr", {}, ...["#", "Job", "Tenant", "State", "Priority", "Wants", "Why it waits"].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, ...queue.map((q) => h("tr", {},
      h("td", { class: "num" }, q.position ?? "—"),
      h("td", {}, q.jobId ? h("a", { href: `#/jobs/${q.jobId}` }, q.jobId) : h("span", { class: "muted" }, "another tenant's job")),
      h("td", {}, q.tenant ?? "—"), h("td", {}, stateBadge(q.state)), h("td", { class: "num" }, q.priority ?? "—"),
      h("td", {}, `${q.gpuCount} × ${q.gpuType}`), h("td", {}, q.queuedReason || "—", q.queuedReasonKind ? h("span", { class: "muted" }, ` (${q.queuedReasonKind})`) : null)))));
}

function deviceChip(dev) {
  const held = dev.jobId != null;
  return h(held ? "a" : "span", { class: `device${held ? " held" : ""}`, href: held ? `#/jobs/${dev.jobId}` : null, title: held ? `held by ${dev.jobId}` : "free" },
    `${dev.index}:${dev.deviceType}${held ? " " + dev.jobId.slice(-6) : ""}`);
}

function nodeCard(n) {
  return h("div", { class: `nodecard${n.quarantined ? " quarantined" : ""}`, "data-node": n.nodeId },
    h("strong", {}, n.nodeId), " ", h("span", { class: "muted" }, n.state || ""),
    n.quarantined ? h("div", { class: "error" }, "quarantined") : null,
    h("div", { class: "muted" }, `reputation ${n.reputation == null ? "—" : num(n.reputation)}`),
    h("div", { class: "devices" }, ...n.devices.map(deviceChip)));
}

function topology(admin) {
  return h("div", { id: "topology" }, ...admin.racks.map((rack) => h("section", { "data-rack": rack.rack },
    h("h3", {}, `rack ${rack.rack ?? "—"}`),
    ...rack.domains.map((d) => h("div", { "data-domain": d.domain },
      h("div", { class: "muted" }, `NVLink domain ${d.domain ?? "—"}`),
      h("div", { class: "nodes" }, ...d.nodes.map(nodeCard)))))));
}

export async function render(main, _, ctx) {
  const cap = h("section", { class: "card", "aria-labelledby": "cap-h" }, h("h2", { id: "cap-h" }, "Capacity"));
  const q = h("section", { class: "card", "aria-labelledby": "queue-h" }, h("h2", { id: "queue-h" }, "Queue"));
  const topo = isAdmin(ctx.me) ? h("section", { class: "card", "aria-labelledby": "topo-h" }, h("h2", { id: "topo-h" }, "Racks, NVLink domains, nodes")) : null;
  main.replaceChildren(...[h("h1", {}, "Cluster"), h("div", { class: "grid" }, cap, q), topo].filter(Boolean));
  async function load() {
    const c = await api("/v1/cluster", { signal: ctx.signal });
    cap.replaceChildren(cap.firstChild, capacityTable(c.capacity));
    q.replaceChildren(q.firstChild, queueTable(c.queue));
    if (topo) topo.replaceChildren(topo.firstChild, topology(await api("/v1/admin/cluster", { signal: ctx.signal })));
  }
  await load();
  let pending = null;
  liveJobs({ signal: ctx.signal, poll: load, onJob: () => { pending ??= setTimeout(() => { pending = null; load().catch(() => {}); }, 1000); } });
}

const COLORS = { lostWork: "#e07b73", launchRestore: "#e8b04a", checkpointStall: "#b48ad6", hang: "#7f8896", replicaDown: "#6fa8c7", idle: "#c9ced6" };

function ledgerRow(name, g) {
  const parts = [{ label: label("productive"), value: g.productiveDeviceSeconds, color: "#5fae7a" }, { label: label("inFlight"), value: g.inFlightDeviceSeconds, color: "#9ecae1" },
    ...Object.entries(g.wasted || {}).map(([k, v]) => ({ label: label(k), value: v, color: COLORS[k] || "#999" }))];
  return h("tr", { "data-tenant": name }, h("th", { scope: "row" }, name), h("td", { class: "num" }, pct(g.goodput)),
    h("td", { class: "num" }, seconds(g.allocatedDeviceSeconds)), h("td", { class: "num" }, seconds(g.wastedDeviceSeconds)),
    h("td", { style: "min-width:240px" }, stackedBar(parts, g.allocatedDeviceSeconds)));
}

const HISTORY_ROWS = 12;
/** A time tick: to the minute, or to the second when the ticks are less than a minute apart. */
const clock = (ms, step) => new Date(ms).toLocaleString("en-GB", { month: "short", day: "2-digit", hour: "2-digit", minute: "2-digit", second: step != null && step < 60_000 ? "2-digit" : undefined });

/** One tenant's goodput per interval as a line over time (x: the interval's end), the newest rows as a table. */
function historyFigure(name, intervals) {
  const points = intervals.filter((i) => i.goodputToDate != null);
  const table = h("table", { "data-history-table": name },
    h("thead", {}, h("tr", {}, ...["From", "To", "Goodput in it", "To date", "Allocated", "Productive", "Wasted"].map((t, i) => h("th", { scope: "col", class: i > 1 ? "num" : null }, t)))),
    h("tbody", {}, ...intervals.slice(-HISTORY_ROWS).reverse().map((i) => h("tr", {},
      h("td", {}, when(i.start)), h("td", {}, when(i.end)), h("td", { class: "num" }, pct(i.goodput)), h("td", { class: "num" }, pct(i.goodputToDate)),
      h("td", { class: "num" }, seconds(i.allocatedDeviceSeconds)), h("td", { class: "num" }, seconds(i.productiveDeviceSeconds)),
      h("td", { class: "num" }, seconds(i.wastedDeviceSeconds))))));
  return h("figure", { "data-history": name, "data-intervals": intervals.length },
    h("figcaption", {}, h("strong", {}, name), h("span", { class: "muted" }, ` ${int(intervals.length)} intervals`)),
    lineChart({ name: `goodput-${name}`, label: `${name}: goodput to date`, steps: points.map((i) => Date.parse(i.end)), values: points.map((i) => i.goodputToDate), format: (v) => pct(v, 0), formatX: clock, xSteps: TIME_STEPS_MS }),
    intervals.length ? h("details", {}, h("summary", {}, "The newest intervals"), table) : h("p", { class: "muted" }, "No interval yet: the API samples every tenant's ledger every few minutes."));
}

export async function renderGoodput(main, _, ctx) {
  const all = isAdmin(ctx.me) ? "?all=true" : "";
  const [report, history] = await Promise.all([
    api(`/v1/goodput${all}`, { signal: ctx.signal }),
    api(`/v1/goodput/history${all}`, { signal: ctx.signal }).catch((e) => ({ error: e.message })),
  ]);
  const ledgers = report.tenants || { [report.tenant]: report.ledger };
  const series = history.error ? {} : { [history.tenant]: history.intervals, ...history.tenants }; // own tenant first
  main.replaceChildren(h("h1", {}, "Goodput"),
    h("section", { class: "card" }, h("p", { class: "muted" }, `${int(report.jobs)} jobs of ${report.tenant} summed. Productive device-time is steps a READY checkpoint or the final model saved; the rest is wasted by cause.`),
      h("table", { id: "goodput-tenants" }, h("thead", {}, h("tr", {}, ...["Tenant", "Goodput", "Allocated", "Wasted", "Breakdown"].map((t) => h("th", { scope: "col" }, t)))),
        h("tbody", {}, ...Object.entries(ledgers).map(([k, v]) => ledgerRow(k, v))))),
    h("section", { class: "card", "aria-labelledby": "goodput-history-h" }, h("h2", { id: "goodput-history-h" }, "Over time"),
      history.error ? h("p", { class: "error" }, `The goodput history could not be read: ${history.error}`)
        : h("p", { class: "muted" }, `Goodput to date, sampled every ${seconds(history.bucketSeconds)} (productive ÷ allocated device-time so far). The table also gives each interval's own ratio, which can pass 100 %: steps count as productive when a checkpoint saves them, possibly an interval after they ran.`),
      h("div", { class: "charts", id: "goodput-history" }, ...Object.entries(series).map(([k, v]) => historyFigure(k, v)))));
  const t = setTimeout(() => { if (!ctx.signal.aborted) window.dispatchEvent(new HashChangeEvent("hashchange")); }, 60_000);
  ctx.signal.addEventListener("abort", () => clearTimeout(t), { once: true });
}
