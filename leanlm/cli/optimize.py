"""`leanlm optimize`: sweep compressed variants, measure quality against cost, draw the Pareto frontier, recommend."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import Progress
from rich.table import Table

from leanlm.bench.workload import read_prompts
from leanlm.cli.common import Model, Threads, app, err, out
from leanlm.errors import LeanLMError
from leanlm.optimize.job import optimize as run
from leanlm.optimize.pareto import Budget
from leanlm.optimize.plan import parse_slo
from leanlm.optimize.sweep import Settings
from leanlm.optimize.variants import draft_variants, read_variants

DEFAULT_BUDGET = "ppl_gap=0.02"
DEFAULT_SLO = "p95_e2e=3s"  # the lectures' example


@app.command()
def optimize(
    model: Model = "smollm2-135m",
    budget: Annotated[str, typer.Option(help="limits, comma-separated: latency_ms (TPOT served alone), ttft_ms, "
                                             "memory_mb (weights), rps (requests/s a replica serves within --slo, at "
                                             "least), ppl_gap (0.02: perplexity at most 2% above the original's), kl "
                                             "(nats/token), pass1; with a quality limit the variant serving the most "
                                             "requests/s within it is recommended, else the most faithful within the "
                                             "cost limits")] = DEFAULT_BUDGET,
    slo: Annotated[str, typer.Option(help="the latency a replica must keep, as `leanlm plan --slo`: STAT_METRIC=VALUE "
                                          "terms, e.g. p95_e2e=3s,p99_ttft=500ms")] = DEFAULT_SLO,
    rps: Annotated[Optional[float], typer.Option(help="expected requests/s: print how many replicas (machines like "
                                                      "this one) each frontier variant needs for it")] = None,
    cache_hit: Annotated[float, typer.Option(help="with --rps: fraction of requests a cache answers, in [0, 1)")] = 0.0,
    prompts: Annotated[Optional[Path], typer.Option(help="time the variants on these prompts (JSONL: {\"prompt\": "
                                                         "...} or {\"messages\": [...]} a line, e.g. your traffic); "
                                                         "default: passages of the built-in evaluation text, half "
                                                         "as chat requests")] = None,
    levels: Annotated[str, typer.Option(help="concurrencies each served variant is loaded at, starting with "
                                             "1")] = "1,4,16",
    recipes: Annotated[str, typer.Option(help="variants to sweep: default, quick, or a YAML file listing {name, "
                                              "steps: \\[quantize/prune recipe steps], dtype, kv_cache: auto|int8, "
                                              "prompt_lookup: N, draft: MODEL}")] = "default",
    quick: Annotated[bool, typer.Option(help="the quick sweep: 6 variants, 4096 evaluation tokens, 16 calibration "
                                             "windows of 256 tokens, served eager (no --compile, whose graphs take "
                                             "10-35 s per batch size), 16 timed requests a level; under 10 minutes "
                                             "on 2 cores")] = False,
    data: Annotated[Optional[Path], typer.Option(help="evaluation and calibration text (default: the built-in "
                                                      "splits)")] = None,
    eval_tokens: Annotated[Optional[int], typer.Option(help="evaluation tokens (default 16384, quick 4096)")] = None,
    samples: Annotated[Optional[int], typer.Option(help="calibration windows (default 128 of 512 tokens, quick 16 of "
                                                        "256)")] = None,
    mixed: Annotated[Optional[bool], typer.Option("--mixed/--no-mixed", help="measure each projection's sensitivity "
                                                   "(sensitivity.png) and sweep a knapsack 4/8-bit mix against "
                                                   "uniform w4 g32 at its size (default: on, off with --quick)")] = None,
    humaneval: Annotated[int, typer.Option(help="code models: HumanEval pass@1 on the first N problems (164: all), "
                                               "each completion run sandboxed; 0: off")] = 0,
    ray: Annotated[Optional[str], typer.Option(help="measure the variants as tasks on this Ray cluster (`local`: a "
                                                    "new local instance), a node's CPUs each; the nodes must share "
                                                    "leanlm's cache directory")] = None,
    eager: Annotated[bool, typer.Option(help="serve and time the variants without --compile (--quick always "
                                             "does)")] = False,
    output: Annotated[Path, typer.Option("--output", "-o", help="directory for report.html, pareto.png, "
                                                                "results.json and recommended/ (a re-run reuses "
                                                                "every measured row)")] = Path("optimize-out"),
    threads: Threads = None,
) -> None:
    """The main job: make compressed variants of MODEL (quantization, int8 KV cache, prompt lookup, pruning),
    measure each one's quality and serve it as the report says to, timed under load; draw quality against latency,
    memory and requests/s within --slo with the Pareto frontiers, recommend the best variant within --budget, copy
    it to DIR/recommended and print the `leanlm serve` command for it (and with --rps, the replicas it needs)."""
    limits, terms = Budget.parse(budget), parse_slo(slo)
    try:
        loads = tuple(int(x) for x in levels.split(","))
    except ValueError:
        raise LeanLMError(f"--levels {levels!r}: give concurrencies separated by commas, e.g. 1,4,16") from None
    if loads[0] != 1 or any(n < 1 for n in loads) or list(loads) != sorted(set(loads)):
        raise LeanLMError(f"--levels {levels!r}: rising concurrencies starting with 1, e.g. 1,4,16")
    if rps is not None and not rps > 0 or not 0 <= cache_hit < 1:
        raise LeanLMError("--rps must be above zero and --cache-hit a fraction in [0, 1)")
    if prompts is not None:
        read_prompts(prompts)  # a bad file fails now, not after the first build
    variants = read_variants("quick" if quick and recipes == "default" else recipes)
    if recipes == "default" and not quick:
        variants += draft_variants(model)
    for name, value in (("eval-tokens", eval_tokens), ("samples", samples)):
        if value is not None and value < 1:
            raise LeanLMError(f"--{name} must be at least 1")
    if humaneval < 0:
        raise LeanLMError("--humaneval must not be negative")
    if output.exists() and not (output / "results.json").exists() and any(output.iterdir()):
        raise LeanLMError(f"{output} exists and is not an optimize output; choose a new directory")
    settings = Settings(eval_tokens=eval_tokens or (4096 if quick else 16384), data=str(data) if data else None,
                        samples=samples or (16 if quick else 128), seq_len=256 if quick else 512,
                        prompts=str(prompts) if prompts else None, levels=loads, requests=16 if quick else 32,
                        compiled=not (eager or quick), threads=threads, humaneval=humaneval)
    mixed = not quick if mixed is None else mixed
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("optimize", total=len(variants) + 2 * mixed)

        def status(text: str) -> None:  # a log (stderr not a terminal) gets each step as a line
            bar.update(task, description=text)
            if not err.is_terminal:
                err.print(f"{time.strftime('%H:%M:%S')} {text}", highlight=False)

        outcome = run(model, variants, limits, settings, output, terms, status=status,
                      on_row=lambda row: bar.advance(task), ray_address=ray, mixed=mixed, rps=rps,
                      cache_hit=cache_hit)
    for name, why in outcome.failed.items():
        err.print(f"[yellow]not measured:[/] {name}: {why}", highlight=False, soft_wrap=True)
    out.print(_table(outcome.rows, outcome.recommended))
    if outcome.best is None:
        out.print(f"no variant fits --budget {budget}; see the budget column")
    else:
        out.print(f"recommended: [bold]{outcome.best['name']}[/] -> {output / 'recommended'}")
        out.print(f"serve it: {outcome.serve_command}", soft_wrap=True, highlight=False)
    for name, lines in outcome.capacity.items():
        out.print(f"\nreplicas for {rps:g} req/s, {name}:", highlight=False, markup=False)
        out.print("\n".join("  " + line for line in lines), highlight=False, markup=False, soft_wrap=True)
    out.print(f"report: {output / 'report.html'}, {output / 'pareto.png'}, {output / 'results.json'}")


def _table(rows: list[dict], recommended: int | None) -> Table:
    table = Table(title="variants (quality on held-out text; served: TPOT and TTFT alone, RPS within the SLO)")
    extra = [(key, title) for key, title in (("pass1", "pass@1"), ("replicas", "replicas"))
             if any(r.get(key) is not None for r in rows)]
    for col in ("variant", "ppl", "gap", "KL", "top-1", "TPOT ms", "TTFT ms", "RPS", *(t for _, t in extra),
                "weights MB", "frontier", "budget"):
        table.add_column(col, justify="left" if col in ("variant", "frontier", "budget") else "right")
    for i, r in enumerate(rows):
        name = r["name"] + (" *" if i == recommended else "")
        table.add_row(name, f"{r['perplexity']:.3f}", f"{r['ppl_gap']:+.2%}", f"{r['kl']:.4f}", f"{r['top1']:.1%}",
                      f"{r['tpot_ms']:.2f}", f"{r['ttft_ms']:.0f}", f"{r['rps']:.2f}",
                      *("–" if r.get(k) is None else f"{r[k]}" if k == "replicas" else f"{r[k]:.1%}" for k, _ in extra),
                      f"{r['memory_mb']:.0f}", ", ".join(a.removesuffix("_ms").removesuffix("_mb") for a in r["on_frontier"]),
                      r["over_budget"] or "fits")
    return table
