// A small time-series chart: an SVG line with its area over a fixed window, the latest
// value and the window's peak as text. Gaps (null) break the line.

const SVG = "http://www.w3.org/2000/svg";
const W = 300;
const H = 72;

export class Chart {
  constructor(parent, { title, unit, format, windowS, kind }) {
    this.format = format;
    this.unit = unit;
    this.windowS = windowS;
    this.points = []; // [seconds, value | null]
    this.since = null; // the first point's time: the chart spans what it has, up to windowS
    this.node = document.createElement("figure");
    this.node.className = `chart ${kind}`;
    this.node.dataset.chart = kind;
    const head = document.createElement("figcaption");
    const name = document.createElement("span");
    name.textContent = title;
    this.value = document.createElement("strong");
    this.value.textContent = "–";
    head.append(name, this.value);
    this.svg = document.createElementNS(SVG, "svg");
    this.svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    this.svg.setAttribute("preserveAspectRatio", "none");
    this.svg.setAttribute("role", "img");
    this.svg.setAttribute("aria-label", title);
    this.area = document.createElementNS(SVG, "path");
    this.area.setAttribute("class", "area");
    this.line = document.createElementNS(SVG, "path");
    this.line.setAttribute("class", "line");
    this.line.setAttribute("vector-effect", "non-scaling-stroke");
    this.svg.append(this.area, this.line);
    this.foot = document.createElement("div");
    this.foot.className = "chart-foot";
    this.node.append(head, this.svg, this.foot);
    parent.append(this.node);
  }

  push(t, v) {
    if (this.since === null) this.since = t;
    this.points.push([t, v]);
    while (this.points.length && this.points[0][0] < t - this.windowS) this.points.shift();
    this.draw(t);
  }

  draw(now) {
    const values = this.points.map((p) => p[1]).filter((v) => v !== null);
    const peak = Math.max(0, ...values);
    const top = niceCeiling(peak);
    const span = Math.min(this.windowS, Math.max(60, now - this.since));
    const x = (t) => ((t - (now - span)) / span) * W;
    const y = (v) => H - 2 - (v / top) * (H - 6);
    let line = "";
    let area = "";
    let run = [];
    const flush = () => {
      if (run.length) {
        const pts = run.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`);
        line += `M${pts.join("L")}`;
        area += `M${x(run[0][0]).toFixed(1)},${H}L${pts.join("L")}L${x(run[run.length - 1][0]).toFixed(1)},${H}Z`;
      }
      run = [];
    };
    for (const p of this.points) {
      if (p[1] === null) flush();
      else run.push(p);
    }
    flush();
    this.line.setAttribute("d", line);
    this.area.setAttribute("d", area);
    const last = this.points.length ? this.points[this.points.length - 1][1] : null;
    this.value.textContent = last === null ? "–" : `${this.format(last)} ${this.unit}`;
    const minutes = Math.max(1, Math.round(span / 60));
    this.foot.textContent = `last ${minutes} min · peak ${values.length ? this.format(peak) : "–"} ${this.unit}`;
  }
}

function niceCeiling(v) {
  if (v <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}
