"""The sweep's outputs: results.json, the quality-vs-cost plots as PNG, and report.html (one self-contained page,
no network: the plots are SVG drawn by a few lines of script from the embedded rows)."""

from __future__ import annotations

import html
import json
from pathlib import Path

from leanlm.optimize.pareto import frontier

AXES = {"tpot_ms": "TPOT served alone (ms/token)", "memory_mb": "weights in memory (MB)",
        "rps": "requests/s one replica serves within the SLO"}
HIGHER_IS_BETTER = ("rps",)  # the other axes are costs


def frontiers(rows: list[dict]) -> dict[str, list[int]]:
    """Indices of the rows on the perplexity-vs-cost frontier, per axis (the request rate counts as a negative cost)."""
    sign = {axis: -1 if axis in HIGHER_IS_BETTER else 1 for axis in AXES}
    return {axis: frontier([(sign[axis] * r[axis], r["perplexity"]) for r in rows]) for axis in AXES}


def write_png(rows: list[dict], fronts: dict[str, list[int]], recommended: int | None, path: Path, title: str,
              ppl_limit: float | None = None) -> None:
    """Perplexity against TPOT, memory and requests/s at the SLO, side by side; the frontier drawn, the
    recommendation ringed."""
    import matplotlib  # heavy: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(AXES), figsize=(6.2 * len(AXES), 5.2), constrained_layout=True)
    for ax, (axis, label) in zip(axes, AXES.items()):
        front = fronts[axis]
        xs, ys = [r[axis] for r in rows], [r["perplexity"] for r in rows]
        ax.scatter(xs, ys, color="#9aa4b1", zorder=2, label="variant")
        ax.plot([xs[i] for i in front], [ys[i] for i in front], "-o", color="#1f6feb", zorder=3, label="Pareto frontier",
                drawstyle="steps-post")
        if recommended is not None:
            ax.scatter([xs[recommended]], [ys[recommended]], s=260, facecolors="none", edgecolors="#d1242f",
                       linewidths=2, zorder=4, label="recommended")
        if ppl_limit is not None:
            ax.axhline(ppl_limit, color="#d1242f", linestyle="--", linewidth=1, label="perplexity budget")
        for x, y, r in zip(xs, ys, rows):
            ax.annotate(r["name"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("perplexity (lower is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_html(rows: list[dict], fronts: dict[str, list[int]], recommended: int | None, path: Path, title: str,
               summary: list[str], images: list[str] = (), capacity: dict[str, list[str]] | None = None) -> None:
    """report.html: the plots (pick the quality measure on Y; a variant's served curve on hover), the
    recommendation, every row's numbers, the replicas each frontier variant needs (`capacity`, reasoned line by
    line) and the PNGs next to it (`images`, file names in the same folder)."""
    data = json.dumps({"rows": rows, "recommended": recommended, "axes": AXES, "better": HIGHER_IS_BETTER})
    notes = "".join(f"<li>{html.escape(line)}</li>" for line in summary)
    if capacity:
        notes += "".join(f"<li>capacity, {html.escape(name)}:<pre>{html.escape(chr(10).join(lines))}</pre></li>"
                         for name, lines in capacity.items())
    figures = "".join(f'<p><img src="{html.escape(name)}" alt="{html.escape(name)}" style="max-width:100%"></p>'
                      for name in images)
    page = _PAGE.replace("__TITLE__", html.escape(title)).replace("__NOTES__", notes).replace("__IMAGES__", figures)
    path.write_text(page.replace("__DATA__", data.replace("</", "<\\/")))


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1f2328}
h1{font-size:20px}.plots{display:flex;flex-wrap:wrap;gap:16px}
svg{border:1px solid #d0d7de;border-radius:6px;background:#fff}
.dot{fill:#9aa4b1}.front{fill:#1f6feb}.over{fill:#fff;stroke:#9aa4b1;stroke-width:1.5}.line{fill:none;stroke:#1f6feb;stroke-width:2}
.rec{fill:none;stroke:#d1242f;stroke-width:2.5}.lab{font-size:11px;fill:#57606a}.axis{font-size:12px;fill:#1f2328}
#tip{position:fixed;pointer-events:none;background:#1f2328;color:#fff;padding:6px 8px;border-radius:4px;font-size:12px;display:none;white-space:pre}
table{border-collapse:collapse;margin-top:16px;font-size:13px}th,td{padding:4px 8px;border-bottom:1px solid #d0d7de;text-align:right}
th{cursor:pointer;background:#f6f8fa}td:first-child,th:first-child{text-align:left}tr.isrec{background:#fff1f0}tr.isfront td:first-child{font-weight:600}
</style></head><body data-errors="">
<h1>__TITLE__</h1><ul>__NOTES__</ul>
<label>quality on Y: <select id="y"><option value="perplexity">perplexity</option><option value="kl">KL to the original (nats/token)</option>
<option value="disagree">top-1 disagreement</option></select></label>
<div class="plots" id="plots"></div><div id="tip"></div>
<table id="rows"></table>
__IMAGES__
<script>
window.onerror = message => { document.body.dataset.errors += message + ";"; };
const D = __DATA__;
const rows = D.rows.map((r, i) => Object.assign({i, disagree: 1 - r.top1}, r));
const fmt = (v, d = 3) => v == null ? "–" : (Math.abs(v) >= 100 ? v.toFixed(0) : Number(v.toPrecision(d)).toString());
function frontier(pts) {  // both coordinates costs; equal points both stay
  const order = pts.map((p, i) => i).sort((a, b) => pts[a][0] - pts[b][0] || pts[a][1] - pts[b][1]);
  const kept = []; let best = Infinity;
  for (const i of order) {
    const last = kept.length ? pts[kept[kept.length - 1]] : null;
    if (pts[i][1] < best || (last && last[0] === pts[i][0] && last[1] === pts[i][1])) { kept.push(i); best = Math.min(best, pts[i][1]); }
  }
  return kept;
}
function plot(axis, label, y) {
  const W = 560, H = 380, L = 64, R = 16, T = 16, B = 48;
  const xs = rows.map(r => r[axis]), ys = rows.map(r => r[y]), sign = D.better.includes(axis) ? -1 : 1;
  const pad = (lo, hi) => { const d = (hi - lo) || Math.abs(hi) || 1; return [lo - 0.08 * d, hi + 0.08 * d]; };
  const [x0, x1] = pad(Math.min(...xs), Math.max(...xs)), [y0, y1] = pad(Math.min(...ys), Math.max(...ys));
  const X = v => L + (v - x0) / (x1 - x0) * (W - L - R), Y = v => H - B - (v - y0) / (y1 - y0) * (H - T - B);
  const front = frontier(rows.map(r => [sign * r[axis], r[y]]));
  let s = `<svg width="${W}" height="${H}" viewBox="0 0 ${W} ${H}">`;
  const tick = (v, lo, hi) => v.toFixed(Math.max(0, Math.ceil(-Math.log10((hi - lo) / 4)) + 1));  // ticks stay distinct
  for (let k = 0; k <= 4; k++) {
    const xv = x0 + k * (x1 - x0) / 4, yv = y0 + k * (y1 - y0) / 4;
    s += `<text class="axis" x="${X(xv)}" y="${H - B + 16}" text-anchor="middle">${tick(xv, x0, x1)}</text>`;
    s += `<text class="axis" x="${L - 6}" y="${Y(yv) + 4}" text-anchor="end">${tick(yv, y0, y1)}</text>`;
    s += `<line x1="${L}" x2="${W - R}" y1="${Y(yv)}" y2="${Y(yv)}" stroke="#eaeef2"/>`;
  }
  s += `<text class="axis" x="${(L + W - R) / 2}" y="${H - 10}" text-anchor="middle">${label}</text>`;
  s += `<text class="axis" transform="translate(14 ${(T + H - B) / 2}) rotate(-90)" text-anchor="middle">${document.getElementById("y").selectedOptions[0].text}</text>`;
  const steps = front.flatMap((i, k) => k ? [[xs[i], ys[front[k - 1]]], [xs[i], ys[i]]] : [[xs[i], ys[i]]]);
  s += `<polyline class="line" points="${steps.map(([x, y]) => X(x) + "," + Y(y)).join(" ")}"/>`;
  rows.forEach((r, i) => {
    const cls = r.over_budget ? "over" : front.includes(i) ? "front" : "dot";
    s += `<circle class="${cls}" data-i="${i}" cx="${X(xs[i])}" cy="${Y(ys[i])}" r="6"/>`;
    s += `<text class="lab" x="${X(xs[i]) + 8}" y="${Y(ys[i]) - 7}">${r.name}</text>`;
    if (i === D.recommended) s += `<circle class="rec" cx="${X(xs[i])}" cy="${Y(ys[i])}" r="12"/>`;
  });
  return s + "</svg>";
}
const COLS = [["name", "variant"], ["perplexity", "ppl"], ["ppl_gap", "ppl gap"], ["kl", "KL"], ["top1", "top-1"],
  ["dp_rms", "RMS Δp"], ["tpot_ms", "TPOT ms"], ["ttft_ms", "TTFT ms"], ["tokens_per_s", "tok/s"], ["rps", "RPS at SLO"],
  ["throughput", "tok/s, top load"], ["replicas", "replicas"],
  ["memory_mb", "weights MB"], ["peak_memory_mb", "peak RSS MB"], ["bits_per_weight", "bits/weight"], ["mbu", "MBU"], ["mfu", "MFU"],
  ["pass1", "pass@1"], ["build_s", "build s"], ["budget", "budget"]];
let sortKey = null, sortDir = 1;
function table() {
  const order = rows.slice();
  if (sortKey) order.sort((a, b) => ((a[sortKey] ?? Infinity) > (b[sortKey] ?? Infinity) ? 1 : -1) * sortDir);
  let s = "<tr>" + COLS.map(([k, t]) => `<th data-k="${k}">${t}</th>`).join("") + "</tr>";
  for (const r of order) {
    const cls = (r.i === D.recommended ? "isrec " : "") + (r.on_frontier ? "isfront" : "");
    s += `<tr class="${cls}">` + COLS.map(([k]) => {
      const v = r[k];
      if (k === "name") return `<td>${v}${r.i === D.recommended ? " ★" : ""}</td>`;
      if (k === "budget") return `<td>${r.over_budget ? r.over_budget : "fits"}</td>`;
      if (k === "ppl_gap") return `<td>${v == null ? "–" : (100 * v).toFixed(2) + "%"}</td>`;
      if (k === "mbu" || k === "mfu" || k === "top1") return `<td>${v == null ? "–" : (100 * v).toFixed(1) + "%"}</td>`;
      return `<td>${typeof v === "number" ? fmt(v, 4) : "–"}</td>`;
    }).join("") + "</tr>";
  }
  document.getElementById("rows").innerHTML = s;
  document.querySelectorAll("th").forEach(th => th.onclick = () => {
    sortDir = sortKey === th.dataset.k ? -sortDir : 1; sortKey = th.dataset.k; table(); });
}
function draw() {
  const y = document.getElementById("y").value;
  document.getElementById("plots").innerHTML = Object.entries(D.axes).map(([a, l]) => plot(a, l, y)).join("");
  const tip = document.getElementById("tip");
  document.querySelectorAll("circle[data-i]").forEach(c => {
    c.onmousemove = e => { const r = rows[+c.dataset.i];
      tip.textContent = `${r.name}\\nperplexity ${fmt(r.perplexity, 5)} (gap ${(100 * r.ppl_gap).toFixed(2)}%)\\nKL ${fmt(r.kl)}  top-1 ${(100 * r.top1).toFixed(1)}%\\nTPOT ${fmt(r.tpot_ms)} ms  TTFT ${fmt(r.ttft_ms)} ms\\nweights ${fmt(r.memory_mb)} MB\\n${fmt(r.rps)} req/s within the SLO (${r.rps_at})\\nserved:` +
        r.curve.map(c => `\\n  ${c.max_concurrency} at once: ${fmt(c.request_throughput)} req/s, ${fmt(c.output_throughput)} tok/s, TPOT p50 ${fmt(c.tpot_ms.p50)} ms, E2E p95 ${fmt(c.e2el_ms.p95)} ms`).join("") +
        (r.over_budget ? `\\nover budget: ${r.over_budget}` : "");
      tip.style.display = "block"; tip.style.left = e.clientX + 12 + "px"; tip.style.top = e.clientY + 12 + "px"; };
    c.onmouseleave = () => tip.style.display = "none";
  });
}
document.getElementById("y").onchange = draw;
draw(); table();
document.body.dataset.drawn = "1";
</script></body></html>
"""
