"""`leanlm optimize` as a function: sweep, mark the frontier and the budget, recommend, write the outputs."""

from __future__ import annotations

import json
import shlex
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from leanlm.bench.probe import device_name
from leanlm.errors import LeanLMError
from leanlm.optimize import mixed as mix
from leanlm.optimize.pareto import Budget, recommend
from leanlm.optimize.report import frontiers, write_html, write_png
from leanlm.optimize.sensitivity import sensitivity_chart
from leanlm.optimize.sweep import Settings, Sweep
from leanlm.optimize.variants import Variant


@dataclass
class Outcome:
    rows: list[dict]  # each Measured.to_dict() + on_frontier, over_budget
    recommended: int | None
    serve_command: str | None
    output: Path
    failed: dict[str, str]  # variant -> why it could not be measured

    @property
    def best(self) -> dict | None:
        return None if self.recommended is None else self.rows[self.recommended]


def serve_command(row: dict, model_dir: Path) -> str:
    """The `leanlm serve` line that runs a variant as it was measured: compiled decode steps, but for an int8 KV
    cache, whose steps the engine runs eager (its quantization sits outside the graph; Sweep.cost times it so)."""
    v = row["variant"]
    cmd = ["leanlm", "serve", str(model_dir)] + (["--compile"] if v["kv_cache"] != "int8" else [])
    if v["dtype"] != "bfloat16":
        cmd += ["--dtype", v["dtype"]]
    if v["kv_cache"] == "int8":
        cmd += ["--kv-cache", "int8"]
    if v["prompt_lookup"]:
        cmd += ["--prompt-lookup", str(v["prompt_lookup"])]
    if v.get("draft"):
        cmd += ["--draft", v["draft"]]
    return shlex.join(cmd)


def optimize(model: str, variants: tuple[Variant, ...], budget: Budget, settings: Settings, output: Path,
             status=lambda text: None, on_row=lambda row: None, cache_root: Path | None = None,
             ray_address: str | None = None, mixed: bool = False) -> Outcome:
    """Measure every variant (cached; on a Ray cluster with `ray_address`), then write results.json, pareto.png,
    report.html and the recommended variant's model directory (output/recommended) into `output`. With `mixed`,
    first the per-projection sensitivity (sensitivity.png), and two more variants: uniform w4 g32 and the knapsack's
    4/8-bit mix at its size (optimize.mixed)."""
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
        r["over_budget"] = "; ".join(budget.breaks(r))
    fronts = frontiers(rows)
    for i, r in enumerate(rows):
        r["on_frontier"] = [axis for axis, front in fronts.items() if i in front]
    best = recommend(rows, budget)
    command = None
    target = output / "recommended"
    if target.exists():
        shutil.rmtree(target)
    if best is not None:
        shutil.copytree(rows[best]["model_dir"], target)
        command = serve_command(rows[best], target)
    title = f"leanlm optimize: {model}"
    summary = [
        f"machine: {device_name()}, {rows[0]['threads']} thread(s) timed; "
        f"budget: {_budget_text(budget)}",
        f"recommended: {rows[best]['name']} ({command})" if best is not None else
        "recommended: none; every variant breaks the budget (see the budget column)",
        f"quality on {rows[0]['tokens']} tokens of {'the built-in evaluation text' if not settings.data else settings.data}; "
        f"cost at batch 1: a {settings.prompt_tokens}-token prompt, {settings.new_tokens} new tokens"
        + ((", compiled decode" + ("" if settings.cpp_wrapper else " (Python launcher)")) if settings.compiled
           else ", eager decode")
        + (f"; throughput with {settings.concurrency} requests at once" if settings.concurrency else ""),
    ]
    summary += [f"not measured: {name}: {why}" for name, why in sweep.failed.items()]
    if any(r.get("speedup") for r in rows):
        summary.append("speculative variants' TPOT is the plain TPOT divided by the speedup measured A/B: prompt "
                       "lookup on input-grounded prompts (summaries, extraction, edits; on free-form text it gains "
                       "less, often nothing), a draft model on code prompts")
    ppl_limit = base_ppl * (1 + budget.ppl_gap) if budget.ppl_gap is not None and base_ppl else None
    write_png(rows, fronts, best, output / "pareto.png", title, ppl_limit)
    write_html(rows, fronts, best, output / "report.html", title, summary, images)
    (output / "results.json").write_text(json.dumps({
        "model": model, "budget": asdict(budget), "settings": asdict(settings), "recommended": best,
        "serve_command": command, "frontier": fronts, "rows": rows, "failed": sweep.failed,
        "seconds": time.perf_counter() - start,
    }, indent=1))
    return Outcome(rows, best, command, output, sweep.failed)


def _budget_text(budget: Budget) -> str:
    terms = [f"{k}={v:g}" for k, v in asdict(budget).items() if v is not None]
    return ", ".join(terms) or "none (the most faithful variant is recommended)"
