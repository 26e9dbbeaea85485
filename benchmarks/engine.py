"""The serving engine on this CPU: KV waste, offline throughput against peers, where a decode step's time goes,
time to first token with prefix caching, and what deterministic mode costs.

    python benchmarks/engine.py [--model smollm2-135m] [--quick] [--no-peers] [--no-vllm] [--no-compile]
                                [--no-256] [--sections 12345] [--threads N] [--json FILE]

Five markdown tables on stdout (after a header naming the CPU, its flags and the thread count); progress on
stderr. All leanlm numbers come from one process and one loaded model, its layers packed for leanlm's kernels where
this CPU runs them (models.layers.pack_linears, as `LLM` and `leanlm serve` do with a model they load). Peers run
the same offline workload: transformers `generate` one request at a time (in this process) and vLLM's CPU build (its
own environment, a subprocess): see benchmarks/engine_peers.py. Whole-model speeds move 20-45% between processes on
these VMs: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import leanlm.engine.engine as engine_module
from leanlm.analysis.memory import kv_bytes_per_token, param_count, weight_bytes_read
from leanlm.cache.paged import KVPool, cdiv
from leanlm.engine import LLM, Engine, EngineConfig
from leanlm.engine.compiled import row_ranges
from leanlm.engine.config import OFFLINE_BATCHED_TOKENS
from leanlm.generation.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
import engine_peers  # noqa: E402  (a sibling script, not a package module)

GiB = 1 << 30
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Ids from 100 up: random text like vLLM's random dataset, without the special tokens at the bottom."""
    return [rng.randrange(100, vocab) for _ in range(n)]


def cpu_header(model, args) -> str:
    from leanlm import kernels
    from leanlm.bench.probe import device_name

    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), [])
    ops = kernels.ops()
    return (f"# leanlm engine benchmark: {args.model} ({str(model.dtype).removeprefix('torch.')})\n\n"
            f"CPU: {device_name('cpu')}; flags: {' '.join(f for f in FLAGS if f in flags)}; "
            f"leanlm kernels: {ops.isa() if ops else 'not built'}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s){'; --quick workloads' if args.quick else ''}\n")


# 1. KV waste ----------------------------------------------------------------------------------------------------

# what each scheme holds for the running sequences (keys of kv_waste's samples)
SCHEMES = {"paged (16-token blocks)": "paged", "static: prompt + max_tokens": "request",
           "static: context window": "window"}


def kv_waste(model, tok, n: int, prompts: tuple[int, int], outputs: tuple[int, int]) -> dict:
    """Run a mixed-length workload all at once; after every step sample what the paged pool holds against what is
    used, and what static reservations would hold for the same running sequences. Time-averaged: each sample is
    weighted by the duration of the step that follows it (the time that memory stays held)."""
    rng, cfg, bs = random.Random(0), model.config, 16
    work = [(rng.randint(*prompts), rng.randint(*outputs)) for _ in range(n)]
    ids = [random_ids(rng, p, cfg.vocab_size) for p, _ in work]
    out = {"requests": n, "prompts": prompts, "outputs": outputs, "runs": {}}
    for kv in ("auto", "int8"):
        per_block = KVPool.bytes_per_block(cfg, bs, model.dtype, kv == "int8")
        # every request's final length, + the scheduler's 1% watermark and the compiled step's scratch block
        budget = (sum(cdiv(p + o, bs) for p, o in work) * 102 // 100 + 4) * per_block
        engine = Engine(model, tok, EngineConfig(kv_cache_memory=budget, block_size=bs, kv_cache=kv))
        for i, (prompt, (_, o)) in enumerate(zip(ids, work)):
            engine.add_request(f"w{i}", prompt, greedy(o))
        samples, durations, tokens, start = [], [], 0, time.perf_counter()
        while engine.has_work:
            t0 = time.perf_counter()
            tokens += len(engine.step())
            durations.append(time.perf_counter() - t0)
            run = engine.scheduler.running
            samples.append(dict(seqs=len(run), used=sum(s.num_computed for s in run),
                                paged=sum(len(s.block_table) for s in run) * bs,
                                full=sum(cdiv(s.num_computed, bs) for s in run) * bs,  # blocks the computed fill
                                request=sum(s.num_prompt + s.max_tokens for s in run),
                                window=len(run) * cfg.max_position))
        wall = time.perf_counter() - start
        weights = durations[1:] + [0.0]

        def avg(key: str) -> float:
            return sum(w * s[key] for w, s in zip(weights, samples)) / sum(weights)

        rows = {}
        for name, key in SCHEMES.items():
            step_avg = statistics.mean((s[key] - s["used"]) / s[key] for s in samples if s[key])
            rows[name] = dict(waste=1 - avg("used") / avg(key), waste_step_avg=step_avg,
                              tokens_per_seq=avg(key) / avg("seqs"),
                              seqs_per_gib=GiB / (avg(key) / avg("seqs") * per_block / bs))
        out["runs"][kv] = dict(
            rows=rows, bytes_per_token=per_block // bs, steps=len(samples),
            preemptions=engine.scheduler.num_preemptions,
            peak_running=max(s["seqs"] for s in samples), mean_running=avg("seqs"), wall_s=wall,
            output_tok_s=tokens / wall, partial_blocks=(avg("full") - avg("used")) / avg("paged"),
            prompt_ahead=(avg("paged") - avg("full")) / avg("paged"),
            pool_tokens_per_gib=KVPool.from_budget(cfg, GiB, bs, model.dtype, None, kv == "int8").num_blocks * bs)
        log(f"kv waste, {kv} pool: {len(samples)} steps, {wall:.1f} s")
    return out


def print_kv_waste(r: dict) -> None:
    print(f"\n## 1. KV cache waste: {r['requests']} requests at once, prompts {r['prompts'][0]}..{r['prompts'][1]} "
          f"random tokens, outputs {r['outputs'][0]}..{r['outputs'][1]} (greedy, EOS ignored)\n")
    print("| scheme | KV dtype | tokens held per running seq | waste, time avg | waste, step avg | KV bytes/token "
          "| seqs in 1 GiB |\n|---|---|---:|---:|---:|---:|---:|")
    for kv, run in r["runs"].items():
        for name, row in run["rows"].items():
            if kv == "int8" and name.startswith("static"):
                continue  # the same reservations as the 16-bit rows, at the int8 bytes per token
            print(f"| {name} | {'int8 + scale' if kv == 'int8' else 'model dtype'} | {row['tokens_per_seq']:.0f} "
                  f"| {row['waste']:.1%} | {row['waste_step_avg']:.1%} | {run['bytes_per_token']} "
                  f"| {row['seqs_per_gib']:.0f} |")
    for kv, run in r["runs"].items():
        print(f"\n{kv} pool: {run['steps']} steps, {run['mean_running']:.0f} running on average (at most "
              f"{run['peak_running']}), {run['preemptions']} preemptions, {run['wall_s']:.1f} s "
              f"({run['output_tok_s']:.0f} output tok/s). Paged waste = {run['prompt_ahead']:.1%} prompt blocks taken "
              f"ahead of their chunks + {run['partial_blocks']:.1%} partial last blocks. A 1 GiB pool holds "
              f"{run['pool_tokens_per_gib']} tokens.")
    print("\nTarget: paged waste < 4%. Time avg: each sample after a step weighted by the next step's wall time.")


# 2. Offline throughput ------------------------------------------------------------------------------------------

def compile_warmup(llm: LLM, n: int) -> dict[str, float]:
    """Compile every decode graph a batch of up to n sequences runs (seconds each, by the batch sizes it covers): a
    batch of its first size's 4-token prompts (one prefill step) and one decode-only step."""
    seconds = {}
    for lo, hi in row_ranges(llm.engine.model, n):
        start = time.perf_counter()
        llm.generate([[100 + i] * 4 for i in range(lo)], greedy(2), progress=False)
        seconds[f"{lo}-{hi}"] = time.perf_counter() - start
        log(f"  batch sizes {lo}-{hi}: {seconds[f'{lo}-{hi}']:.0f} s")
    return seconds


def throughput(llm: LLM, prompts: list[list[int]], out_len: int) -> dict:
    before = llm.engine.scheduler.num_preemptions
    start = time.perf_counter()
    outs = llm.generate(prompts, greedy(out_len), progress=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(output_tok_s=tokens / elapsed, elapsed_s=elapsed, preemptions=llm.engine.scheduler.num_preemptions
                - before, total_tok_s=(tokens + sum(map(len, prompts))) / elapsed)


def offline(model, tok, args, engines: dict) -> dict:
    rng, vocab = random.Random(1), model.config.vocab_size
    n, in_len, out_len, sweep_n = (32, 64, 32, 16) if args.quick else (256, 256, 128, 64)
    prompts = [random_ids(rng, in_len, vocab) for _ in range(n)]
    r = dict(num_prompts=n, input_len=in_len, output_len=out_len, rows={})
    for kind, llm in engines.items():
        llm.generate([random_ids(rng, 16, vocab)], greedy(4), progress=False)  # warm-up: thread pool, kernels
        if kind == "compiled":
            log(f"compiling the decode graphs up to {n} sequences ...")
            r["compile_s"] = compile_warmup(llm, n)
        log(f"throughput, leanlm {kind}: {n} prompts ...")
        r["rows"][f"leanlm LLM.generate, {kind}"] = throughput(llm, prompts, out_len)
    if not args.no_peers:
        model_dir = str(args.model_dir)
        r["rows"]["transformers generate, one by one"] = engine_peers.transformers_one_by_one(
            model_dir, 1 if args.quick else 3, in_len, out_len)
        if not args.no_vllm:
            r["rows"][f"vLLM CPU {engine_peers.VLLM_VERSION}"] = engine_peers.vllm_throughput(
                model_dir, n, in_len, out_len)
    r["sweep"], r["sweep_prompts"] = {}, sweep_n
    sweep_prompts = prompts[:sweep_n]
    for budget in (512, 1024, 2048, 4096):
        log(f"max_num_batched_tokens={budget}: {sweep_n} prompts ...")
        llm = LLM(model, tok, threads=args.threads, kv_cache_memory="1GiB", max_num_batched_tokens=budget)
        llm.generate([random_ids(rng, 16, vocab)], greedy(4), progress=False)
        r["sweep"][budget] = throughput(llm, sweep_prompts, out_len)
    return r


def print_offline(r: dict) -> None:
    print(f"\n## 2. Offline throughput: {r['num_prompts']} prompts of {r['input_len']} random tokens, "
          f"{r['output_len']} output tokens each (greedy, EOS ignored; KV pool 4 GiB; LLM's step budget, "
          f"{OFFLINE_BATCHED_TOKENS} tokens)\n")
    ours = [v for k, v in r["rows"].items() if k.startswith("leanlm")]
    print("| engine | output tok/s | elapsed s | preemptions | leanlm / it (" + ", ".join(
        k.rsplit(" ", 1)[-1] for k in r["rows"] if k.startswith("leanlm")) + ") |\n|---|---:|---:|---:|---|")
    for name, v in r["rows"].items():
        if v is None:
            print(f"| {name} | - | - | - | not available |")
            continue
        ratios = "" if v in ours else ", ".join(f"{o['output_tok_s'] / v['output_tok_s']:.1f}x" for o in ours)
        setup = f" ({v['setup']})" if "setup" in v else ""
        print(f"| {name}{setup} | {v['output_tok_s']:.1f} | {v['elapsed_s']:.1f} | {v.get('preemptions', '-')} "
              f"| {ratios} |")
    compiled = "" if "compile_s" not in r else (
        f" Compiled warm-up, untimed: {sum(r['compile_s'].values()):.0f} s for {len(r['compile_s'])} decode graphs.")
    print(f"\nTargets: leanlm / transformers >= 10x, leanlm / vLLM >= 2x.{compiled} (vLLM's throughput mode samples at "
          "temperature 1; leanlm and transformers decode greedily.)")
    print(f"\nPrompt-chunk budget (eager engine, KV pool 1 GiB), the first {r['sweep_prompts']} of those prompts:\n")
    print("| max_num_batched_tokens | output tok/s | elapsed s |\n|---:|---:|---:|")
    for budget, v in r["sweep"].items():
        print(f"| {budget} | {v['output_tok_s']:.1f} | {v['elapsed_s']:.1f} |")
    best = max(r["sweep"], key=lambda b: r["sweep"][b]["output_tok_s"])
    print(f"\nBest: {best} (LLM's default, offline: {OFFLINE_BATCHED_TOKENS}; a server's: "
          f"{EngineConfig().max_num_batched_tokens}).")


# 3. Where a decode step's time goes -----------------------------------------------------------------------------

# profiler op names by part; leanlm's kernels live in a namespace leanlm_<source hash> (leanlm.kernels)
PROJECTIONS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::_weight_int8pack_mm", "::int8_gemv",
               "::int4_gemv", "aten::_int_mm", "::quantize_rows", "::int8_amx", "::codebook_gemv", "::bf16_gemm",
               "_packed_gemm", "::int4_q8_gemm", "::int8_24_gemv", "_amx")
ATTENTION = ("::paged_attention", "aten::index_copy", "scaled_dot_product", "::put_keys")
LABELS = {"leanlm.sample": "sampling", "leanlm.schedule": "scheduler"}
PARTS = ("projections", "attention", "other ops", "forward, outside ops", "sampling", "scheduler",
         "rest of step (Python)")


@contextlib.contextmanager
def instrumented(engine: Engine, seconds: dict):
    """Label (for the profiler) and time the three phases of Engine.step: schedule, forward (runner.run), sample.
    Wraps them in this process only; the engine's code is untouched."""
    def wrap(fn, label):
        def timed(*a, **kw):
            with torch.profiler.record_function(label):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - t0
        return timed

    sample_rows = engine_module.sample_rows  # Engine.step looks the name up in its module at every call
    engine_module.sample_rows = wrap(sample_rows, "leanlm.sample")
    engine.scheduler.schedule = wrap(engine.scheduler.schedule, "leanlm.schedule")
    engine.runner.run = wrap(engine.runner.run, "leanlm.forward")
    try:
        yield
    finally:
        engine_module.sample_rows = sample_rows
        del engine.scheduler.schedule, engine.runner.run  # the class's methods again


def part_of(evt) -> str:
    """The part a profiler event's self time belongs to: the nearest enclosing op or label that names one. Inside the
    forward, time in no op is Python between ops (eager) or inductor's fused kernels, which the profiler cannot see
    (compiled)."""
    is_op, e = "::" in evt.name, evt
    while e is not None:
        if e.name in LABELS:
            return LABELS[e.name]
        if "::" in e.name and any(p in e.name for p in PROJECTIONS):
            return "projections"
        if "::" in e.name and any(a in e.name for a in ATTENTION):
            return "attention"
        if e.name == "leanlm.forward":
            return "other ops" if is_op else "forward, outside ops"
        e = e.cpu_parent
    return "other ops" if is_op else "rest of step (Python)"


def step_split(engine: Engine, n: int, prompt_len: int, steps: int, peak) -> dict:
    """n sequences with prompt_len-token prompts, all prefilled; then decode steps: timed, then profiled."""
    model, cfg, rng = engine.model, engine.model.config, random.Random(3)
    ramp = cdiv(n * prompt_len, engine.scheduler.max_num_batched_tokens) + 1
    for i in range(n):
        engine.add_request(f"prof{n}-{i}", random_ids(rng, prompt_len, cfg.vocab_size), greedy(ramp + 2 * steps + 8))
    while engine.scheduler.waiting or any(s.remaining > 1 for s in engine.scheduler.running):
        engine.step()
    seconds, walls, contexts = {}, [], []
    with instrumented(engine, seconds):
        for _ in range(2):  # warm-up (a compiled engine's bucket is compiled by now)
            engine.step()
        seconds.clear()
        for _ in range(steps):
            contexts.append(sum(s.num_computed + 1 for s in engine.scheduler.running))  # keys each query reads
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
        phases = {LABELS.get(k, "forward"): v / steps for k, v in seconds.items()}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            profiled = time.perf_counter() - t0
    assert len(engine.scheduler.running) == n, "every sequence should still be decoding"
    for request_id in list(engine.requests):
        engine.abort(request_id)
    parts = dict.fromkeys(PARTS, 0.0)
    for evt in prof.events():
        parts[part_of(evt)] += evt.self_cpu_time_total / 1e6
    parts["rest of step (Python)"] += profiled - sum(parts.values())
    step, context = statistics.median(walls), statistics.mean(contexts)
    weights, kv = weight_bytes_read(model), context * kv_bytes_per_token(cfg, engine.pool.k[0].element_size())
    proj_flops = 2 * param_count(cfg).read_per_token * n
    attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context  # q.k and p.v, 2 FLOPs a product
    bw, fl = peak.bandwidth_gbs * 1e9, peak.gflops * 1e9
    # the two parts run one after the other, so their floors add: each at its own roofline
    floor = max(weights / bw, proj_flops / fl) + max(kv / bw, attn_flops / fl)
    return dict(n=n, parts={k: v / steps for k, v in parts.items()}, profiled_step_s=profiled / steps, step_s=step,
                phases=phases, weight_bytes=weights, kv_bytes=kv, proj_flops=proj_flops, attn_flops=attn_flops,
                mbu=(weights + kv) / bw / step, mfu=(proj_flops + attn_flops) / fl / step, floor_s=floor,
                top=max(parts, key=parts.get))


def print_split(r: dict, peak) -> None:
    print(f"\n## 3. One decode step, prompts of {r['prompt_len']} tokens all prefilled (profiler self time per step, "
          f"ms, share of the profiled step)\n")
    cols = r["configs"]
    print("| part | " + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols))
    for part in PARTS:
        cells = (f"{c['parts'][part] * 1e3:.1f} ({c['parts'][part] / c['profiled_step_s']:.0%})" for c in cols.values())
        print(f"| {part} | " + " | ".join(cells) + " |")
    bw, fl = peak.bandwidth_gbs * 1e9, peak.gflops * 1e9

    def rate(amount: float, seconds: float, top: float) -> str:
        return f"{amount / seconds / 1e9:.1f} ({amount / seconds / top:.0%})" if seconds else "inside the graph"

    rows = {
        "profiled step, ms": lambda c: f"{c['profiled_step_s'] * 1e3:.1f}",
        "**step, unprofiled (median), ms**": lambda c: f"**{c['step_s'] * 1e3:.1f}**",
        "forward / sampling / scheduler (mean), ms": lambda c: " / ".join(
            f"{c['phases'].get(k, 0) * 1e3:.1f}" for k in ("forward", "sampling", "scheduler")),
        "decode tok/s": lambda c: f"{c['n'] / c['step_s']:.0f}",
        "weights + KV read, MB": lambda c: f"{c['weight_bytes'] / 1e6:.0f} + {c['kv_bytes'] / 1e6:.0f}",
        "projection + attention GFLOP": lambda c: f"{c['proj_flops'] / 1e9:.1f} + {c['attn_flops'] / 1e9:.2f}",
        "MBU / MFU": lambda c: f"{c['mbu']:.0%} / {c['mfu']:.0%}",
        "projections: GFLOP/s (of peak)": lambda c: rate(c["proj_flops"], c["parts"]["projections"], fl),
        "attention: KV GB/s (of bandwidth)": lambda c: rate(c["kv_bytes"], c["parts"]["attention"], bw),
        "floor, ms": lambda c: f"{c['floor_s'] * 1e3:.1f}",
        "step / floor": lambda c: f"{c['step_s'] / c['floor_s']:.1f}x",
    }
    for name, cell in rows.items():
        print(f"| {name} | " + " | ".join(cell(c) for c in cols.values()) + " |")
    print(f"\nPeaks (leanlm.bench.probe): {peak.bandwidth_gbs:.1f} GB/s read, {peak.gflops:.0f} GFLOP/s "
          f"{peak.dtype} matmul. MBU = (weights + KV read) / step / bandwidth; MFU = (2 x params x seqs + attention "
          "FLOPs) / step / matmul peak. Floor: projections at their roofline (16-bit weights: compute-bound from "
          f"~{peak.gflops / peak.bandwidth_gbs:.0f} rows on) plus attention at its own (memory-bound: each key and "
          "value read once). Compiled: the profiler cannot see inductor's fused kernels nor, here, the projections "
          "inside the graph: they count as 'forward, outside ops'.\n")
    for name, c in cols.items():
        attn_floor = max(c["kv_bytes"] / bw, c["attn_flops"] / fl)
        print(f"- {name}: {c['step_s'] / c['floor_s']:.1f}x its floor; largest part {c['top']} "
              f"({c['parts'][c['top']] / c['profiled_step_s']:.0%}); attention takes "
              f"{c['parts']['attention'] / attn_floor:.1f}x its memory floor.")


# 4. TTFT with prefix caching ------------------------------------------------------------------------------------

def ttft(model, tok, prefix_len: int, new: int, reps: int) -> dict:
    """A prompt whose first prefix_len tokens were seen before: time to its first token, prefix caching on vs off."""
    rng, vocab = random.Random(4), model.config.vocab_size
    prefix = random_ids(rng, prefix_len, vocab)
    engines = {on: Engine(model, tok, EngineConfig(kv_cache_memory=256 << 20, prefix_caching=on)) for on in (True, False)}

    def first_token(engine: Engine, request_id: str, prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        (seq,) = engine.add_request(request_id, prompt, greedy(1))
        while not seq.finished:
            engine.step()
        return time.perf_counter() - start, seq.num_cached

    for engine in engines.values():  # the prefix is seen (and the engine warmed up)
        first_token(engine, "seen", prefix + random_ids(rng, new, vocab))
    runs = {on: [] for on in engines}
    for i in range(reps):  # interleaved, so a slow spell of the machine hits both
        suffix = random_ids(rng, new, vocab)
        for on, engine in engines.items():
            runs[on].append(first_token(engine, f"ttft{i}", prefix + suffix))
    return dict(prefix_len=prefix_len, new=new, rows={on: dict(median_s=statistics.median(t for t, _ in r),
                                                               runs_s=[t for t, _ in r], cached=r[-1][1])
                                                      for on, r in runs.items()})


def print_ttft(r: dict) -> None:
    print(f"\n## 4. TTFT of a {r['prefix_len']} + {r['new']}-token prompt whose first {r['prefix_len']} tokens were "
          f"seen before (max_tokens=1, eager engine, median of {len(r['rows'][True]['runs_s'])})\n")
    print("| prefix caching | TTFT, median ms | runs, ms | prompt tokens from the cache |\n|---|---:|---|---:|")
    for on, v in r["rows"].items():
        print(f"| {'on' if on else 'off'} | {v['median_s'] * 1e3:.1f} | "
              f"{', '.join(f'{t * 1e3:.0f}' for t in v['runs_s'])} | {v['cached']} |")
    speedup = r["rows"][False]["median_s"] / r["rows"][True]["median_s"]
    print(f"\nCaching makes TTFT {speedup:.1f}x lower (target >= 5x).")


def deterministic_cost(model, tok, n: int, in_len: int, out_len: int) -> dict:
    """Output tokens/s with and without deterministic=True: a batch of n prompts, and one prompt alone."""
    rng = random.Random(5)
    prompts = [random_ids(rng, in_len, model.config.vocab_size) for _ in range(n)]
    rows = {}
    for mode in (False, True):
        llm = LLM(model, tok, kv_cache_memory="1GiB", deterministic=mode, quiet=True)
        llm.generate(prompts[:2], greedy(4), progress=False)  # warm-up
        log(f"deterministic={mode}: {n} prompts, then 1 ...")
        rows[(mode, n)] = throughput(llm, prompts, out_len)
        rows[(mode, 1)] = throughput(llm, prompts[:1], out_len)
    return {"in_len": in_len, "out_len": out_len,
            "rows": {f"{'deterministic' if mode else 'normal'}, {k} prompt(s)": r for (mode, k), r in rows.items()},
            "cost": {k: rows[(False, k)]["output_tok_s"] / rows[(True, k)]["output_tok_s"] for k in (n, 1)}}


def print_deterministic(r: dict) -> None:
    print(f"\n## 5. Deterministic mode's cost ({r['in_len']} prompt tokens, {r['out_len']} output tokens, eager)\n")
    print("| run | output tok/s | elapsed s |\n|---|---:|---:|")
    for name, row in r["rows"].items():
        print(f"| {name} | {row['output_tok_s']:.1f} | {row['elapsed_s']:.1f} |")
    print("\n" + ", ".join(f"{k} prompt(s): normal / deterministic = {v:.2f}x" for k, v in r["cost"].items()) +
          ". Deterministic: every token a single query through the paged-attention kernel, products on tiles of 16 "
          "rows (engine/runner.py).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="zoo name or HF model directory")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    ap.add_argument("--quick", action="store_true", help="small workloads: a smoke run of every table")
    ap.add_argument("--no-peers", action="store_true", help="skip transformers and vLLM")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM (minutes to start)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled engine (each bucket compiles ~1 min)")
    ap.add_argument("--no-256", action="store_true", help="skip the step split at 256 sequences")
    ap.add_argument("--sections", default="12345", help="which of the five tables to make (default all: 12345)")
    ap.add_argument("--json", type=Path, help="also write every number to this file")
    args = ap.parse_args()

    from leanlm.models.loading import load
    from leanlm.models.layers import pack_linears
    from leanlm.bench.probe import peaks
    from leanlm.models.zoo import resolve
    from leanlm.runtime import cpu_count, matmul_dtype, set_threads

    set_threads(args.threads or cpu_count())
    args.model_dir = resolve(args.model, progress=False)
    model, tok = load(args.model, progress=False)
    pack_linears(model)  # what LLM(name) and `leanlm serve` run
    probe = peaks("cpu", torch.get_num_threads())
    dtype = str(matmul_dtype(model.dtype, model.device)).removeprefix("torch.")
    peak = argparse.Namespace(bandwidth_gbs=probe.bandwidth_gbs, gflops=probe.matmul_gflops[dtype], dtype=dtype)
    print(cpu_header(model, args), flush=True)
    results = {"cpu": cpu_header(model, args), "peaks": vars(peak)}

    def emit(section: str, result: dict, show) -> None:
        """Print a section's table now, and keep the JSON file current (a later section may fail or be stopped)."""
        results[section] = result
        show(result)
        sys.stdout.flush()
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")

    quick = args.quick
    if "1" in args.sections:
        emit("kv_waste", kv_waste(model, tok, *((12, (32, 256), (16, 64)) if quick else (48, (32, 768), (16, 384)))),
             print_kv_waste)
    engines = {"eager": LLM(model, tok, threads=args.threads, kv_cache_memory="4GiB")}
    if not args.no_compile:
        engines["compiled"] = LLM(model, tok, threads=args.threads, kv_cache_memory="4GiB", compile=True)
    if "2" in args.sections:
        emit("offline", offline(model, tok, args, engines), print_offline)
    if "3" in args.sections:
        prompt_len, steps = (64, 3) if quick else (256, 6)
        split = {"prompt_len": prompt_len, "configs": {}}
        for n in [8] if quick else [32] + ([] if args.no_256 else [256]):
            for kind, llm in engines.items():
                log(f"decode step split, {kind}, {n} sequences ...")
                split["configs"][f"{kind}, {n} seqs"] = step_split(llm.engine, n, prompt_len, steps, peak)
        emit("step_split", split, lambda r: print_split(r, peak))
    del engines  # their KV pools
    if "4" in args.sections:
        emit("ttft", ttft(model, tok, *((256, 16, 3) if quick else (1024, 16, 3))), print_ttft)
    if "5" in args.sections:
        emit("deterministic", deterministic_cost(model, tok, *((8, 64, 16) if quick else (64, 256, 64))),
             print_deterministic)

if __name__ == "__main__":
    main()
