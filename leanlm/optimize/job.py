"""`leanlm optimize` as a function: sweep, mark the frontier and the budget, recommend, write the outputs."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from leanlm.bench.probe import device_name
from leanlm.bench.workload import describe
from leanlm.errors import LeanLMError
from leanlm.optimize import mixed as mix
from leanlm.optimize.pareto import Budget, recommend
from leanlm.optimize.plan import SloTerm, best_point, check_point, explain, plan
from leanlm.optimize.report import frontiers, write_html, write_png
from leanlm.optimize.sensitivity import sensitivity_chart
from leanlm.optimize.served import serve_command
from leanlm.optimize.sweep import Settings, Sweep
from leanlm.optimize.variants import Variant


@dataclass
class Outcome:
    rows: list[dict]  # each Measured.to_dict() + on_frontier, over_budget
    recommended: int | None
    serve_command: str | None
    output: Path
    failed: dict[str, str]  # variant -> why it could not be measured
    capacity: dict[str, list[str]]  # frontier variant -> how many replicas serve --rps, reasoned line by line

    @property
    def best(self) -> dict | None:
        return None if self.recommended is None else self.rows[self.recommended]


def served_rate(curve: list[dict], slo: list[SloTerm]) -> tuple[float, str]:
    """The highest request rate a served variant was measured to sustain with every SLO term met, and at which
    point; (0, why) when no level measured meets it (optimize.plan, no interpolation)."""
    points = [check_point(row, slo) for row in curve]
    try:
        best = points[best_point(points)]
    except LeanLMError:
        return 0.0, "no level meets the SLO: " + "; ".join(f"{p.label}: {p.why_not()}" for p in points)
    return best.request_throughput, best.label


def capacity(rows: list[dict], indices: list[int], rps: float, cache_hit: float,
             slo: list[SloTerm]) -> dict[str, list[str]]:
    """Per variant (by index): `leanlm plan`'s reasoning, line by line, for `rps` requests/s from its measured curve."""
    lines = {}
    for i in indices:
        r = rows[i]
        try:
            result = plan(rps, slo, r["curve"], cache_hit=cache_hit, source=f"{r['name']}, served")
            r["replicas"] = result.replicas
            lines[r["name"]] = explain(result)
        except LeanLMError as e:
            r["replicas"] = None
            lines[r["name"]] = [str(e)]
    return lines


def optimize(model: str, variants: tuple[Variant, ...], budget: Budget, settings: Settings, output: Path,
             slo: list[SloTerm], status=lambda text: None, on_row=lambda row: None, cache_root: Path | None = None,
             ray_address: str | None = None, mixed: bool = False, rps: float | None = None,
             cache_hit: float = 0.0) -> Outcome:
    """Measure every variant (cached; on a Ray cluster with `ray_address`), read each one's request rate at `slo`
    from its served curve, then write results.json, pareto.png, report.html and the recommended variant's model
    directory (output/recommended) into `output`. With `rps`, the replicas each frontier variant needs for it
    (`cache_hit` of requests never reaching the model). With `mixed`, first the per-projection sensitivity
    (sensitivity.png), and two more variants: uniform w4 g32 and the knapsack's 4/8-bit mix at its size."""
    start = time.perf_counter()
    sweep = Sweep(model, variants, settings, cache_root, status)
    output.mkdir(parents=True, exist_ok=True)
    images = ["pareto.png"]
    if mixed:
        result = mix.sensitivity(sweep.source, sweep.root, status=status)
        sensitivity_chart(result, output / "sensitivity.png", f"{model}: KL when one projection alone is quantized "
                                                              f"({result.tokens} calibration tokens)")
        images.append("sensitivity.png")
        sweep.variants = (*variants, *mix.variants(result))
    rows = [r.to_dict() for r in sweep.run(on_row, ray_address)]
    if not rows:
        raise LeanLMError("no variant could be measured: " + "; ".join(f"{k}: {v}" for k, v in sweep.failed.items()))
    base_ppl = next((r["perplexity"] / (1 + r["ppl_gap"]) for r in rows), None)
    for r in rows:
        r["rps"], r["rps_at"] = served_rate(r["curve"], slo)
        r["over_budget"] = "; ".join(budget.breaks(r))
    fronts = frontiers(rows)
    for i, r in enumerate(rows):
        r["on_frontier"] = [axis for axis, front in fronts.items() if i in front]
    plans = capacity(rows, sorted({i for f in fronts.values() for i in f}), rps, cache_hit, slo) if rps else {}
    best = recommend(rows, budget)
    command = None
    target = output / "recommended"
    if target.exists():
        shutil.rmtree(target)
    if best is not None:
        shutil.copytree(rows[best]["model_dir"], target)
        command = serve_command(rows[best]["variant"], target, settings.compiled, settings.threads)
    title = f"leanlm optimize: {model}"
    summary = [
        f"machine: {device_name()}, served with "
        f"{f'--threads {settings.threads}' if settings.threads else 'the threads leanlm serve picks'}; "
        f"budget: {_budget_text(budget)}",
        f"recommended: {rows[best]['name']} ({command})" if best is not None else
        "recommended: none; every variant breaks the budget (see the budget column)",
        f"quality on {rows[0]['tokens']} tokens of {settings.data or 'the built-in evaluation text'}",
        "cost: each variant served with the command the report prints"
        + (" (with --compile: the server builds every batch size's graph before it answers)" if settings.compiled
           else "")
        + f", loaded at concurrency {', '.join(map(str, settings.levels))} with requests of {settings.new_tokens} "
        f"tokens on {describe(settings.prompts)}; TTFT and TPOT are the medians at concurrency 1, RPS the highest "
        f"request rate measured with {', '.join(map(str, slo))}",
    ]
    summary += [f"not measured: {name}: {why}" for name, why in sweep.failed.items()]
    summary += _slower_than_original(rows, settings.levels[-1])
    ppl_limit = base_ppl * (1 + budget.ppl_gap) if budget.ppl_gap is not None and base_ppl else None
    write_png(rows, fronts, best, output / "pareto.png", title, ppl_limit)
    write_html(rows, fronts, best, output / "report.html", title, summary, images, plans)
    (output / "results.json").write_text(json.dumps({
        "model": model, "budget": asdict(budget), "settings": asdict(settings), "slo": [str(t) for t in slo],
        "rps": rps, "cache_hit": cache_hit, "capacity": plans, "recommended": best,
        "serve_command": command, "frontier": fronts, "rows": rows, "failed": sweep.failed,
        "seconds": time.perf_counter() - start,
    }, indent=1))
    return Outcome(rows, best, command, output, sweep.failed, plans)


def _slower_than_original(rows: list[dict], top: int) -> list[str]:
    """A line for each variant that serves fewer output tokens/s at the top load than the original as it is (the
    unchanged bf16 model, when swept): compression or speculation that costs throughput is flagged, not left to be
    read off a column."""
    plain = {"dtype": "bfloat16", "kv_cache": "auto", "prompt_lookup": 0, "draft": ""}
    base = next((r for r in rows if not r["variant"]["steps"] and all(r["variant"][k] == v for k, v in plain.items())),
                None)
    if base is None:
        return []
    return [f"{r['name']} serves less than {base['name']} under load: {r['throughput']:.0f} against "
            f"{base['throughput']:.0f} output tokens/s at concurrency {top}, {r['rps']:.2f} against {base['rps']:.2f} "
            "requests/s within the SLO" for r in rows if r["throughput"] < base["throughput"]]


def _budget_text(budget: Budget) -> str:
    terms = [f"{k}={v:g}" for k, v in asdict(budget).items() if v is not None]
    return ", ".join(terms) or "none (the most faithful variant is recommended)"
