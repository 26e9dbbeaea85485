"""`leanlm serve` (the OpenAI-compatible server) and `leanlm bench serve` (load against any such server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import Progress

from leanlm.bench.workload import read_prompts
from leanlm.cli.common import DType, Device, KVCache, Model, Threads, _fail, app, err, out
from leanlm.engine import AsyncLLM, EngineConfig
from leanlm.engine.config import check_kv_cache
from leanlm.engine.process import EngineProcess
from leanlm.prompt.compressor import METHODS
from leanlm.serve import serve as run_server
from leanlm.serve.ray import serve_replicas


@app.command()
def serve(
    model: Model,
    host: Annotated[str, typer.Option(help="address to bind (loopback unless you mean to expose it)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(help="require `Authorization: Bearer KEY` on /v1/ routes (visible "
                                                        "in `ps`: prefer --api-key-file or LEANLM_API_KEY)",
                                                   envvar="LEANLM_API_KEY", show_envvar=True)] = None,
    api_key_file: Annotated[Optional[Path], typer.Option(help="read the API key from this file (first line)")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="the model name clients send (default: MODEL's "
                                                                  "name, never its path)")] = None,
    max_n: Annotated[int, typer.Option(help="most completions (n) one request may ask for")] = 16,
    max_num_seqs: Annotated[int, typer.Option(help="most sequences decoded together")] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(help="tokens per engine step (prompt chunks fill it)")] = 1024,
    max_prefill_tokens: Annotated[int, typer.Option(help="most prompt tokens in a step that also decodes (0: what "
                                                         "--max-num-batched-tokens leaves); fewer keep the running "
                                                         "requests' time per token steady while new ones arrive, "
                                                         "at the cost of the new ones' time to first token")] = 0,
    kv_cache_memory: Annotated[str, typer.Option(help="KV cache budget (e.g. 2GiB, or 0.3 of free memory)")] = "2GiB",
    kv_cache: KVCache = "auto",
    max_requests: Annotated[int, typer.Option(help="requests in progress beyond which new ones get 503")] = 512,
    prompt_lookup: Annotated[int, typer.Option(help="prompt-lookup speculation with n-grams up to N (0: off)")] = 0,
    draft: Annotated[Optional[str], typer.Option(help="speculative decoding with this draft model (same tokenizer). "
                                                      "It pays while the target's steps are bandwidth-bound: "
                                                      "qwen2.5-coder-1.5b <- 0.5b on 2 AMX cores, 1.32x output tok/s "
                                                      "at 1 concurrent, 1.19x at 4, 1.55x at 16 "
                                                      "(benchmarks/speculative_serve.py); once steps are compute-"
                                                      "bound (large batches, CPUs without AMX) rejected tokens are "
                                                      "wasted work")] = None,
    num_speculative: Annotated[int, typer.Option(help="tokens proposed per step (prompt lookup or --draft)")] = 4,
    deterministic: Annotated[bool, typer.Option(help="outputs independent of batching, chunking, speculation")] = False,
    pack_weights: Annotated[bool, typer.Option(help="on AVX512-BF16 and AVX2 CPUs, the bf16 model's Linear "
                                               "weights repacked for leanlm's bf16 kernel (Zen 4: 1.8x torch's GEMM at "
                                               "32 rows)")] = True,
    compile: Annotated[bool, typer.Option("--compile/--eager", help="decode-only steps as compiled graphs (CPU), every "
                                          "graph up to --max-num-seqs sequences built before the server answers "
                                          "(2 or 3 graphs, ~1-2 minutes each cold on 2 cores, ~12 s from inductor's "
                                          "cache)")] = False,
    prompt_scorer: Annotated[str, typer.Option(help="the small model that compresses the prompts of requests that ask "
                                                    "for it (\"leanlm\": {\"compress_prompt\": {\"rate\": 0.5}}; "
                                                    "\"auto\": true compresses only where the measured break-even "
                                                    "says it pays); loaded on first use")] = "smollm2-135m",
    prepare_compression: Annotated[Optional[str], typer.Option(help="make this compression method ready before the "
                                                                    "server answers (e.g. classifier: the scorer "
                                                                    "loaded, the classifier made on first use, ~4 "
                                                                    "min on 2 cores, then cached, and the break-even "
                                                                    "for auto measured), not inside the first "
                                                                    "request that asks for it")] = None,
    engine_process: Annotated[bool, typer.Option("--engine-process/--engine-thread", help="the engine core in a "
                                                 "process of its own (vLLM V1's split: no front-end Python holds up "
                                                 "a step under the GIL), or on a thread of the server's: on 2 vCPUs "
                                                 "the thread served as fast or faster (benchmarks/serving.py, "
                                                 "section 8), the process pays where the front end has a core of "
                                                 "its own")] = False,
    replicas: Annotated[int, typer.Option(help="engine replicas behind one endpoint on Ray Serve (leanlm[ray])")] = 1,
    ray_address: Annotated[Optional[str], typer.Option(help="an existing Ray cluster for the replicas, or "
                                                            "`local` (default: a new local instance)")] = None,
    dtype: DType = "auto", device: Device = "auto", threads: Threads = None,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics). SIGTERM drains requests in flight, then exits."""
    start = time.perf_counter()
    if api_key_file is not None:
        try:
            api_key = api_key_file.read_text().splitlines()[0].strip()
        except (OSError, IndexError) as e:
            _fail(f"--api-key-file {api_key_file}: cannot read a key from it ({e or 'empty'})")
    name = served_model_name or Path(model).name  # a directory's path stays private to the server
    config = EngineConfig(kv_cache_memory=kv_cache_memory, kv_cache=check_kv_cache(kv_cache, "--kv-cache"),
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_prefill_tokens=max_prefill_tokens,
                          prompt_lookup=prompt_lookup, draft=draft, num_speculative=num_speculative,
                          deterministic=deterministic, compile=compile, pack_weights=pack_weights)
    if prepare_compression is not None and prepare_compression not in METHODS:
        _fail(f"--prepare-compression must be one of {', '.join(METHODS)}, got {prepare_compression!r}")
    if replicas > 1 or ray_address:
        if engine_process:
            _fail("--engine-process is for one server: each Ray replica steps its engine on a thread of its own")
        serve_replicas(model, name, replicas, host, port, api_key, max_requests, config, ray_address,
                       prompt_scorer=prompt_scorer, max_n=max_n, prepare_compression=prepare_compression,
                       dtype=dtype, device=device, threads=threads)
        return
    front = EngineProcess if engine_process else AsyncLLM
    llm = front(model, config=config, dtype=dtype, device=device, threads=threads)
    err.print(f"leanlm: ready in {time.perf_counter() - start:.1f} s (the model loaded, its KV cache allocated"
              f"{', every compiled step built' if llm.compiled else ''})",
              highlight=False, markup=False)
    run_server(llm, name, host, port, api_key, max_requests, prompt_scorer=prompt_scorer, max_n=max_n,
               prepare_compression=prepare_compression)


@app.command("bench-serve", hidden=True)  # `leanlm bench serve ...` (main() rewrites it to this verb)
def bench_serve(
    target: Annotated[str, typer.Argument(help="a server's base URL (http://HOST:PORT), or a MODEL to serve with "
                                               "`leanlm serve` on a free loopback port for the run")],
    num_prompts: Annotated[int, typer.Option(help="requests per run")] = 100,
    input_len: Annotated[int, typer.Option(help="prompt tokens (random ids, sent as token ids)")] = 256,
    prompts_file: Annotated[Optional[Path], typer.Option("--prompts", help="send these prompts instead of random ids "
                                                                           "(JSONL: {\"prompt\": ...} or "
                                                                           "{\"messages\": [...]} a line, cycled)")] = None,
    output_len: Annotated[int, typer.Option(help="output tokens (ignore_eos)")] = 128,
    request_rate: Annotated[float, typer.Option(help="requests per second (inf: all at once)")] = float("inf"),
    burstiness: Annotated[float, typer.Option(help="gamma shape of the arrival gaps (1: Poisson)")] = 1.0,
    max_concurrency: Annotated[Optional[int], typer.Option(help="most requests in flight")] = None,
    sweep: Annotated[Optional[str], typer.Option(help="run once per concurrency, e.g. 1,2,4,8,16,32 (random "
                                                 "prompts: each level its own, so that none finds an earlier "
                                                 "level's in the server's prefix cache)")] = None,
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
    # httpx (the load generator's client): only `bench serve` needs it
    from leanlm.bench.serve import (LocalServer, parse_goodput, plot_sweep, random_prompts, run_load, served_model,
                                    summarize, table)

    slos = parse_goodput(goodput or [])
    levels = [int(x) for x in sweep.split(",")] if sweep else [max_concurrency]
    if prompts_file is None:  # level i's prompts drawn with seed + i: a sweep that repeated them measured cache hits
        prompts = [random_prompts(num_prompts + warmup, input_len, vocab, seed + i) for i in range(len(levels))]
    else:
        given = read_prompts(prompts_file)
        prompts = [[given[i % len(given)] for i in range(num_prompts + warmup)]] * len(levels)
    remote = target.startswith(("http://", "https://"))
    server = (contextlib.nullcontext() if remote
              else LocalServer.leanlm(target, model_name or target, shlex.split(serve_args)))
    rows = []
    with server as local:
        url = target if remote else local.url
        name = model_name or served_model(url, api_key)
        for level, sent in zip(levels, prompts):
            with Progress(console=err, transient=True, disable=json_) as bar:
                task = bar.add_task(f"concurrency {level or 'unbounded'}", total=num_prompts)
                results, seconds = asyncio.run(run_load(
                    url, name, sent, output_len, request_rate, burstiness, level, api_key, warmup, seed,
                    progress=lambda: bar.advance(task)))
            rows.append({**summarize(results, seconds, slos), "max_concurrency": level, "rate": request_rate,
                         "input_len": input_len, "output_len": output_len, "model": name, "url": url})
    if plot and sweep:
        plot_sweep({name: rows}, str(plot))
    if json_:
        print(json.dumps(rows if sweep else rows[0]))
    else:
        out.print(table(rows), highlight=False, markup=False)
