// The live cluster view: the broker's stats (/v1/stats, redacted as any client sees
// them) and this edge's Prometheus metrics (/metrics), polled every second. Rates and
// the charts' history are computed here, from the change of counters between polls.

import { apiError } from "./api.js";
import { Chart } from "./chart.js";

const POLL_MS = 1000;
const WINDOW_S = 300; // the charts' span
const TTFT_SPAN_S = 15; // each TTFT point averages the first tokens of this many seconds
const ROLE_ORDER = { prefill: 0, decode: 1, hybrid: 2 };
const MAX_EVENTS = 30;

export class Cluster {
  constructor(api, root, { onReady }) {
    this.api = api;
    this.onReady = onReady;
    this.$ = (id) => root.querySelector(`#${id}`);
    this.tiles = this.$("tiles");
    this.workers = this.$("workers");
    this.events = this.$("events");
    this.note = this.$("cluster-note");
    this.updated = this.$("updated");
    const charts = this.$("charts");
    this.charts = {
      tokens: new Chart(charts, { title: "Throughput", unit: "tok/s", format: fmtRate, windowS: WINDOW_S, kind: "tokens" }),
      ttft: new Chart(charts, { title: "Time to first token", unit: "ms", format: (v) => fmtInt(v), windowS: WINDOW_S, kind: "ttft" }),
      queue: new Chart(charts, { title: "Queued requests", unit: "", format: (v) => fmtInt(v), windowS: WINDOW_S, kind: "queue" }),
    };
    this.samples = []; // {t, stats, metrics} of recent polls, for rates over a span
    this.known = null; // node -> last row, to turn changes into events
    this.brokerUp = null;
    this.statsOff = false;
  }

  start() {
    const tick = async () => {
      if (!document.hidden) {
        try {
          await this.poll();
        } catch (err) {
          this._note(`Cannot reach this edge: ${err.message || err}`);
        }
      }
      setTimeout(tick, POLL_MS);
    };
    tick();
  }

  async poll() {
    const [stats, metrics] = await Promise.all([this._stats(), this._metrics()]);
    const t = performance.now() / 1000;
    this.samples.push({ t, stats, metrics });
    while (this.samples.length > 2 && this.samples[1].t < t - 65) this.samples.shift();
    const prev = this.samples.length > 1 ? this.samples[this.samples.length - 2] : null;

    const up = stats !== null ? true : metrics ? metric(metrics, "tandem_broker_up") === 1 : false;
    if (this.brokerUp !== null && up !== this.brokerUp) this._event(up ? "The broker answers again" : "The broker stopped answering", up ? "up" : "down");
    this.brokerUp = up;
    // Without the stats (turned off, or no key) the edge's tandem_broker_up still tells.
    this.onReady(stats ? readyText(stats) : up ? { ok: true, text: "broker up" } : { ok: false, text: "broker down" });

    const tokens = rate(prev, { t, stats, metrics }, (s) => (s.stats ? (s.stats.counters || {}).tokens || 0 : null),
      (s) => (s.metrics ? metric(s.metrics, "tandem_generation_tokens_total") : null));
    this.charts.tokens.push(t, tokens);
    this.charts.ttft.push(t, this._ttft(TTFT_SPAN_S));
    this.charts.queue.push(t, stats ? stats.queue_depth || 0 : null);
    this._tiles(stats, metrics, tokens);
    if (stats) {
      this._workers(stats.workers || [], prev && prev.stats ? prev.stats.workers || [] : [], prev ? t - prev.t : 0);
      this._changes(stats.workers || []);
    }
    const routing = stats && stats.strategy ? `${String(stats.strategy).replace(/_/g, " ")} routing · ` : "";
    this.updated.textContent = `${routing}updated ${new Date().toLocaleTimeString()}`;
  }

  async _stats() {
    if (this.statsOff) return null;
    let resp;
    try {
      resp = await this.api.fetch("/v1/stats");
    } catch (err) {
      this._note(`Cannot reach this edge: ${err.message || err}`);
      return null;
    }
    if (resp.ok) {
      this._note(null);
      return resp.json();
    }
    const err = await apiError(resp);
    if (resp.status === 404) {
      this.statsOff = true;
      this._note("This edge does not publish the broker's stats (edge.expose_stats = false): only its own metrics are shown.");
    } else if (resp.status === 401) {
      this._note("The cluster view needs the API key (the key button at the top right).");
    } else {
      this._note(`The broker is not answering: ${err.message}`);
    }
    return null;
  }

  async _metrics() {
    try {
      const resp = await fetch("/metrics");
      return resp.ok ? parseMetrics(await resp.text()) : null;
    } catch {
      return null;
    }
  }

  _note(text) {
    this.note.hidden = !text;
    this.note.textContent = text || "";
  }

  // Mean time to first token of the requests that got one in the last `span` seconds.
  _ttft(span) {
    const last = this.samples[this.samples.length - 1];
    if (!last.metrics) return null;
    const base = [...this.samples].reverse().find((s) => s.metrics && s.t <= last.t - span) ||
      this.samples.find((s) => s.metrics);
    if (!base || base === last) return null;
    const n = metric(last.metrics, "tandem_time_to_first_token_seconds_count") - metric(base.metrics, "tandem_time_to_first_token_seconds_count");
    const sum = metric(last.metrics, "tandem_time_to_first_token_seconds_sum") - metric(base.metrics, "tandem_time_to_first_token_seconds_sum");
    return n > 0 && sum >= 0 ? (sum / n) * 1000 : null;
  }

  _tiles(stats, metrics, tokens) {
    const c = (stats && stats.counters) || {};
    const workers = (stats && stats.workers) || [];
    const live = workers.filter((w) => w.state === "up").length;
    const byRole = {};
    for (const w of workers) byRole[w.role] = (byRole[w.role] || 0) + 1;
    const refused = (c.refused_busy || 0) + (c.refused_no_worker || 0) + (c.refused_timeout || 0);
    const minute = this._ttft(60);
    const edgeRefused = metrics ? metricSum(metrics, "tandem_requests_refused_total") : null;
    const tiles = [
      ["workers", "Workers up", stats ? `${live} / ${workers.length}` : "–",
        Object.entries(byRole).map(([r, n]) => `${n} ${r}`).join(" · ") || "none registered", stats && live < workers.length ? "warn" : ""],
      ["queue", "Queue depth", stats ? fmtInt(stats.queue_depth || 0) : "–",
        stats ? `of ${fmtInt(stats.max_queue)} · ${fmtInt((stats.requests || {}).running || 0)} running` : "", ""],
      ["tokens", "Tokens/s", tokens === null ? "–" : fmtRate(tokens), stats ? `${fmtInt(c.tokens || 0)} in all` : "this edge", ""],
      ["ttft", "TTFT", minute === null ? "–" : `${fmtInt(minute)} ms`, "mean, last minute", ""],
      ["refusals", "Refusals", stats ? fmtInt(refused) : "–", stats ? refusals(c, edgeRefused) : "", refused ? "warn" : ""],
      ["migrations", "Migrations", stats ? fmtInt(c.migrations || 0) : "–", stats ? `${c.migrations_exhausted || 0} ran out of retries` : "", ""],
    ];
    this.tiles.replaceChildren(...tiles.map(([key, label, value, sub, tone]) => {
      const tile = h("div", "tile", [h("span", "label", [label]), h("strong", "value", [value]), h("span", "sub", [sub])]);
      tile.title = sub;
      tile.dataset.tile = key;
      if (tone) tile.dataset.tone = tone;
      return tile;
    }));
  }

  _workers(rows, before, dt) {
    const previous = new Map(before.map((w) => [w.node, w]));
    const sorted = [...rows].sort((a, b) => (ROLE_ORDER[a.role] ?? 9) - (ROLE_ORDER[b.role] ?? 9) || String(a.node).localeCompare(String(b.node), undefined, { numeric: true }));
    if (!sorted.length) {
      this.workers.replaceChildren(h("p", "muted", ["No worker has registered with the broker."]));
      return;
    }
    const cards = sorted.map((w) => {
      const old = previous.get(w.node);
      const rateNow = old && dt > 0 && w.tokens >= old.tokens ? (w.tokens - old.tokens) / dt : null;
      return workerCard(w, rateNow);
    });
    this.workers.replaceChildren(...cards);
  }

  _changes(rows) {
    const now = new Map(rows.map((w) => [w.node, w]));
    if (this.known) {
      for (const [node, w] of now) {
        const old = this.known.get(node);
        if (!old) this._event(`${node} joined (${w.role})`, w.state);
        else if (old.state !== w.state) this._event(`${node} is ${w.state} (was ${old.state})`, w.state);
        else if ((w.failures || 0) > (old.failures || 0)) this._event(`${node} failed and is back`, "down");
      }
      for (const node of this.known.keys()) if (!now.has(node)) this._event(`${node} left the cluster`, "down");
    }
    this.known = now;
  }

  _event(text, tone) {
    if (this.events.querySelector(".muted")) this.events.replaceChildren();
    const time = h("time", null, [new Date().toLocaleTimeString()]);
    const item = h("li", null, [time, h("span", null, [text])]);
    item.dataset.tone = tone;
    this.events.prepend(item);
    while (this.events.children.length > MAX_EVENTS) this.events.lastChild.remove();
  }
}

function refusals(c, edge) {
  const parts = [["busy", c.refused_busy], ["no worker", c.refused_no_worker], ["timed out", c.refused_timeout]]
    .filter(([, n]) => n).map(([why, n]) => `${fmtInt(n)} ${why}`);
  if (edge) parts.push(`${fmtInt(edge)} at the edge`);
  return parts.join(" · ") || "none so far";
}

function workerCard(w, tokensPerS) {
  const total = w.total_blocks || 0;
  const used = w.used_blocks ?? Math.max(0, total - (w.free_blocks || 0));
  const hits = w.prefix_queries ? `${Math.round((100 * w.prefix_hits) / w.prefix_queries)}%` : "–";
  const card = h("article", "worker", [
    h("header", null, [
      h("strong", "node", [String(w.node)]),
      h("span", `role role-${w.role}`, [w.role]),
      ...(w.device ? [h("span", "device", [String(w.device)])] : []),
      h("span", `state state-${w.state}`, [w.state]),
    ]),
    h("dl", null, [
      stat("Load", `${fmtInt(w.running || 0)} running` + (w.waiting ? ` · ${fmtInt(w.waiting)} waiting` : ""),
        bar(w.inflight || 0, w.capacity || 0), `${fmtInt(w.waiting || 0)} waiting · ${w.inflight || 0} of ${w.capacity || 0} slots held`),
      stat("KV blocks", `${fmtCount(used)} used · ${fmtCount(Math.max(0, total - used))} free`, bar(used, total), total ? `${((100 * used) / total).toFixed(1)}% of ${fmtInt(total)}` : ""),
      stat("Prefix hits", hits, null, w.prefix_queries ? `${fmtInt(w.prefix_hits)} of ${fmtInt(w.prefix_queries)} prompts` : "no prompt yet"),
      stat("Tokens/s", tokensPerS === null ? "–" : fmtRate(tokensPerS), null, `${fmtInt(w.tokens || 0)} streamed`),
    ]),
    h("footer", "muted", [`${plural((w.dispatched || 0) + (w.decode_targeted || 0), "request")} · ${plural(w.refusals || 0, "refusal")} · ${plural(w.failures || 0, "failure")}` +
      (w.spec_draft_tokens ? ` · ${Math.round((100 * (w.spec_accepted_tokens || 0)) / w.spec_draft_tokens)}% of drafts accepted` : "")]),
  ]);
  card.dataset.node = w.node;
  card.dataset.role = w.role;
  card.dataset.state = w.state;
  return card;
}

function stat(label, value, meter, title) {
  const dd = h("dd", null, [h("span", null, [value])]);
  if (meter) dd.append(meter);
  if (title) dd.title = title;
  return h("div", "stat", [h("dt", null, [label]), dd]);
}

function bar(value, total) {
  const fill = h("span", "fill");
  const share = total > 0 ? Math.min(1, value / total) : 0;
  fill.style.width = `${(share * 100).toFixed(1)}%`;
  const meter = h("span", "bar", [fill]);
  if (share > 0.9) meter.dataset.tone = "bad";
  else if (share > 0.7) meter.dataset.tone = "warn";
  return meter;
}

function readyText(stats) {
  const ready = stats.ready || {};
  if ((ready.hybrid || 0) > 0 || ((ready.prefill || 0) > 0 && (ready.decode || 0) > 0)) return { ok: true, text: "ready" };
  return { ok: false, text: "no worker pair" };
}

// Rate of a counter between two samples: `primary` (the broker's, cluster-wide) when
// both have it, else `fallback` (this edge's); null across a restart or a gap.
function rate(prev, cur, primary, fallback) {
  if (!prev) return null;
  const dt = cur.t - prev.t;
  for (const pick of [primary, fallback]) {
    const a = pick(prev);
    const b = pick(cur);
    if (a !== null && b !== null && !Number.isNaN(a) && !Number.isNaN(b)) return b >= a && dt > 0 ? (b - a) / dt : null;
  }
  return null;
}

// Prometheus text format: name -> [{labels, value}].
export function parseMetrics(text) {
  const out = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const [, k, v] of (m[3] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[k] = v;
    if (!out.has(m[1])) out.set(m[1], []);
    out.get(m[1]).push({ labels, value: Number(m[4]) });
  }
  return out;
}

function metric(metrics, name) {
  const samples = metrics.get(name);
  return samples && samples.length ? samples[0].value : NaN;
}

function metricSum(metrics, name) {
  return (metrics.get(name) || []).reduce((sum, s) => sum + s.value, 0);
}

function h(tag, className, children) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (children) node.append(...children);
  return node;
}

function plural(n, noun) {
  return `${fmtInt(n)} ${noun}${n === 1 ? "" : "s"}`;
}

function fmtInt(v) {
  return Math.round(v).toLocaleString("en-US");
}

const COMPACT = new Intl.NumberFormat("en-US", { notation: "compact", maximumFractionDigits: 1 });

function fmtCount(v) {
  return v >= 10000 ? COMPACT.format(v) : fmtInt(v);
}

function fmtRate(v) {
  return v >= 100 ? fmtInt(v) : v.toFixed(1);
}
