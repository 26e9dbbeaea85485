"""leanlm on an NVIDIA GPU: logits against transformers, batch-1 latency, engine throughput, quantized decode and
the CUDA matrix kernels the quantized layers could use, each next to its peer in one process.

    python benchmarks/gpu.py --model DIR [--model DIR ...] [--random] [--sections pltqk] [--no-compile]

--random: DIR needs only config.json and the tokenizer; the weights are random (seed 0) of that exact shape, for
machines that cannot pull the zoo. Speed depends on shapes only; parity compares the same weights in both.
Sections: p parity, l batch-1 latency, t offline throughput, q quantized decode, s served, k kernels. Tables on stdout,
progress on stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

import leanlm.bench.latency as latency_module
from leanlm.bench.latency import bench
from leanlm.bench.serve import LocalServer
from leanlm.compress.registry import apply
from leanlm.pipeline import make_config
from leanlm.engine import LLM
from leanlm.generation.compiled import CompiledDecoder
from leanlm.generation.sampling import SamplingParams
from leanlm.models.loading import load_model
from leanlm.runtime import synchronize
from leanlm.tokenizer import Tokenizer

CUDA = torch.device("cuda")  # --device cpu only checks the script on a machine without a GPU


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def header(title: str, columns: list[str]) -> None:
    print(f"\n### {title}\n\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns), flush=True)


def row(values: list) -> None:
    """One table row, printed as soon as it is measured (a run cut short keeps what it has)."""
    print("| " + " | ".join((f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}") if isinstance(v, float) else str(v)
                            for v in values) + " |", flush=True)


def timed(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() on the GPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize(CUDA)
        t = time.perf_counter()
        fn()
        synchronize(CUDA)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_copy(src: Path, dst: Path) -> Path:
    """dst: src's config and tokenizer with random bfloat16 weights of the same shapes."""
    import transformers

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(src)
    with torch.device(CUDA):  # initialised on the GPU: on the host, the 1.5B's init ran past 110 s of a lease
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    return dst


def random_ids(path: Path, n: int, length: int, seed: int = 0) -> torch.Tensor:
    """[n, length] ids above the special tokens at the bottom of the vocabulary, on the device."""
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, vocab // 2), min(20000, vocab), (n, length), generator=gen).to(CUDA)


def hf_model(path: Path, dtype: torch.dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(CUDA).eval()


def parity(name: str, path: Path) -> Iterator[list]:
    tokens = random_ids(path, 2, 256, seed=1)
    for dtype in (torch.float32, torch.bfloat16):
        ours = load_model(path, dtype, CUDA)
        with torch.no_grad():
            a = ours(tokens, torch.arange(256, device=CUDA)[None].expand(2, -1)).float()
            del ours
            ref = hf_model(path, dtype)
            b = ref(tokens).logits.float()
            del ref
        yield [name, str(dtype).removeprefix("torch."), float((a - b).abs().max() / b.abs().max()),
               f"{(a.argmax(-1) == b.argmax(-1)).float().mean().item():.1%}"]
        empty_cache()


def hf_latency(path: Path, prompt: int, new: int) -> tuple[float, float]:
    """transformers generate (its default dynamic cache), batch 1, greedy: TTFT and TPOT in seconds."""
    model = hf_model(path, torch.bfloat16)
    ids = random_ids(path, 1, prompt)

    def run(n):
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    ttft = timed(lambda: run(1), reps=5, warmup=2)
    total = timed(lambda: run(new), reps=3, warmup=1)
    return ttft, (total - ttft) / (new - 1)


LATENCY_RUNS = {"eager": ("leanlm eager", False, True), "graph": ("leanlm compiled + CUDA graph", True, True),
                "nograph": ("leanlm compiled, no graph", True, False)}


def latency(name: str, path: Path, runs: list[str]) -> Iterator[list]:
    prompt, new = 512, 128
    model = load_model(path, torch.bfloat16, CUDA)
    for label, compiled, graphs in (LATENCY_RUNS[r] for r in runs if r in LATENCY_RUNS):
        log(f"{name}: {label}")
        latency_module.CompiledDecoder = functools.partial(CompiledDecoder, cuda_graphs=graphs)
        r = bench(model, name, prompt, new, compiled=compiled)
        yield [name, label, r.ttft_ms, r.tpot_ms, r.tokens_per_s, f"{r.mbu:.1%}"]
    latency_module.CompiledDecoder = CompiledDecoder
    del model
    if "transformers" not in runs:
        return
    log(f"{name}: transformers generate")
    ttft, tpot = hf_latency(path, prompt, new)
    yield [name, "transformers generate", ttft * 1e3, tpot * 1e3, 1 / tpot, ""]
    empty_cache()


def throughput(name: str, path: Path, n: int = 256, inp: int = 256, out: int = 128) -> Iterator[list]:
    ids = random_ids(path, n, inp)
    prompts = ids.tolist()
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    llm = LLM(load_model(path, torch.bfloat16, CUDA), Tokenizer(path), kv_cache_memory="16GiB", quiet=True)
    llm.generate(prompts[:8], params, progress=False)  # warm-up
    synchronize(CUDA)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, progress=False)
    synchronize(CUDA)
    seconds = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    yield [name, "leanlm LLM (continuous batching)", n, produced / seconds, seconds]
    del llm
    empty_cache()
    model, batch = hf_model(path, torch.bfloat16), 64
    model.generate(ids[:8], max_new_tokens=4, do_sample=False, pad_token_id=0)
    synchronize(CUDA)
    t = time.perf_counter()
    for i in range(0, n, batch):
        model.generate(ids[i:i + batch], max_new_tokens=out, min_new_tokens=out, do_sample=False, pad_token_id=0)
    synchronize(CUDA)
    seconds = time.perf_counter() - t
    yield [name, f"transformers generate, batches of {batch}", n, n * out / seconds, seconds]
    del model
    empty_cache()


SCHEMES = {"bf16": None, "w8a16": ("rtn", {"bits": 8}), "w4a16": ("rtn", {"bits": 4, "group_size": 128}),
           "w8a8": ("rtn", {"bits": 8, "act_bits": 8}), "fp8": ("fp8", {})}


def quantized(name: str, path: Path, compile: bool, schemes: list[str]) -> Iterator[list]:
    for scheme, spec in ((s, SCHEMES[s]) for s in schemes):
        model = load_model(path, torch.bfloat16, CUDA)
        if spec:
            apply(model, make_config(*spec))
        values = [name, scheme]
        for batch, compiled in ((1, False), (32, False), (1, True))[:3 if compile else 2]:
            try:
                values.append(bench(model, name, 128, 32, batch=batch, compiled=compiled).tokens_per_s)
            except Exception as e:  # noqa: BLE001 - a scheme that fails on this GPU is a finding, not a crash
                values.append(f"error: {type(e).__name__}: {str(e)[:80]}")
            log(f"{name}, {scheme}, batch {batch}, {'compiled' if compiled else 'eager'}: {values[-1]}")
        yield values
        del model
        empty_cache()


SERVE_LEVELS = (1, 8, 32, 64)


def served(name: str, path: Path, modes: list[str], serve_args: list[str]) -> Iterator[list]:
    """`leanlm serve` started cold on a loopback port, once per mode (--eager, --compile) with serve_args; one
    `leanlm bench serve` run per concurrency against it (2 x concurrency requests, at least 8, no warm-up request)."""
    for mode in modes:
        label, extra = " ".join(["leanlm serve", mode, *serve_args]), [mode, *serve_args]
        log(f"{name}: {label}")
        start = time.perf_counter()
        with LocalServer.leanlm(str(path), name, ["--device", CUDA.type, *extra]) as server:
            values = [name, f"{label}, ready in {time.perf_counter() - start:.0f} s"]
            for c in SERVE_LEVELS:
                out = subprocess.run([sys.executable, "-m", "leanlm.cli", "bench-serve", server.url, "--json",
                                      "--warmup", "0", "--max-concurrency", str(c), "--num-prompts", str(max(8, 2 * c)),
                                      "--vocab", "20000"], capture_output=True, text=True, timeout=600)
                if out.returncode:
                    log(f"{out.stderr}\nthe server's log:\n{server.log_tail()}")
                    values.append(f"error: {out.stderr.strip()[-120:]}")
                    continue
                r = json.loads(out.stdout)
                r = r[0] if isinstance(r, list) else r
                values.append(f"{r['output_throughput']:.0f} ({r['tpot_ms']['p50']:.1f} ms)")
                log(f"{name}: {label}, {c} concurrent: {values[-1]}")
        yield values


def kernels(K: int, N: int) -> Iterator[list]:
    """One [M, K] x [N, K]^T product per candidate CUDA kernel, microseconds (or why it does not run)."""
    w = torch.randn(N, K, device=CUDA, dtype=torch.bfloat16) * 0.02
    wq = torch.randint(-127, 128, (N, K), device=CUDA, dtype=torch.int8)
    scales = torch.rand(N, device=CUDA, dtype=torch.bfloat16) * 0.01
    for M in (1, 8, 32, 512):
        x = torch.randn(M, K, device=CUDA, dtype=torch.bfloat16)
        xq = torch.randint(-127, 128, (max(M, 17), K), device=CUDA, dtype=torch.int8)
        cands = {
            "bf16 F.linear": lambda: F.linear(x, w),
            "int8 dequant + linear": lambda: F.linear(x, wq.to(torch.bfloat16) * scales[:, None]),
            "_weight_int8pack_mm": lambda: torch._weight_int8pack_mm(x, wq, scales),
            "_int_mm (M>=17)": lambda: torch._int_mm(xq, wq.t()),
        }
        try:
            packed = torch._convert_weight_to_int4pack(torch.randint(0, 256, (N, K // 2), device=CUDA,
                                                                     dtype=torch.uint8), 8)
            sz = torch.rand(K // 128, N, 2, device=CUDA, dtype=torch.bfloat16)
            cands["_weight_int4pack_mm g128"] = lambda: torch._weight_int4pack_mm(x, packed, 128, sz)
        except Exception as e:  # noqa: BLE001
            yield [M, K, N, "_weight_int4pack_mm", f"error: {type(e).__name__}: {str(e)[:80]}"]
        w8 = w.to(torch.float8_e4m3fn)
        one = torch.ones(1, device=CUDA)
        xs = torch.ones(max(M, 16), 1, device=CUDA)
        x8 = torch.randn(max(M, 16), K, device=CUDA).to(torch.float8_e4m3fn)
        cands["_scaled_mm fp8 row-wise"] = lambda: torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=one.expand(1, N)
                                                                   .contiguous(), out_dtype=torch.bfloat16)
        for label, fn in cands.items():
            try:
                yield [M, K, N, label, timed(fn) * 1e6]
            except Exception as e:  # noqa: BLE001
                yield [M, K, N, label, f"error: {type(e).__name__}: {str(e)[:80]}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="model directory (repeatable)")
    ap.add_argument("--random", action="store_true", help="random weights of the directories' shapes")
    ap.add_argument("--sections", default="pltqk")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled decode rows")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help=f"section q's schemes, of {', '.join(SCHEMES)}")
    ap.add_argument("--latency-runs", default="eager,graph,nograph,transformers",
                    help="section l's rows, of eager, graph, nograph (compiled), transformers")
    ap.add_argument("--serve-modes", default="--eager,--compile", help="section s's servers, of --eager, --compile")
    ap.add_argument("--serve-args", default="", help="more `leanlm serve` options for section s, e.g. "
                    "\"--max-num-seqs 32\" (fewer compiled buckets)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global CUDA
    CUDA = torch.device(args.device)
    if CUDA.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name() if CUDA.type == "cuda" else "cpu (a check of the script only)"
    print(f"# leanlm on {gpu} (torch {torch.__version__}, "
          f"{'random' if args.random else 'real'} weights)")
    tmp = Path(tempfile.mkdtemp(prefix="leanlm-cuda-"))
    models = []
    for m in args.model:
        src = Path(m)
        log(f"preparing {src.name}")
        models.append((src.name, random_copy(src, tmp / src.name) if args.random else src))
    sections = [("p", "Logits against transformers on the GPU (2 x 256 tokens)",
                 ["model", "dtype", "max |diff| / max |logit|", "top-1 agreement"], parity),
                ("l", "Batch-1 latency, bf16 (512-token prompt, 128 new tokens)",
                 ["model", "runtime", "TTFT ms", "TPOT ms", "tokens/s", "MBU"],
                 lambda n, p: latency(n, p, [r for r in args.latency_runs.split(",")
                                             if not (args.no_compile and r in ("graph", "nograph"))])),
                ("t", "Offline throughput, bf16 (256 prompts, 256 in, 128 out, greedy)",
                 ["model", "runtime", "requests", "output tokens/s", "seconds"], throughput),
                ("q", "Quantized decode on the GPU (128-token prompt), tokens/s",
                 ["model", "scheme", "eager batch 1", "eager batch 32", "compiled batch 1"],
                 lambda n, p: quantized(n, p, not args.no_compile, args.schemes.split(","))),
                ("s", "Served on the GPU: `leanlm bench serve` (256 in / 128 out, cold server), output tokens/s",
                 ["model", "server", *(f"{c} concurrent" for c in SERVE_LEVELS)],
                 lambda n, p: served(n, p, args.serve_modes.split(","), args.serve_args.split()))]
    for key, title, columns, fn in sections:
        if key in args.sections:
            header(title, columns)
            for name, path in models:
                try:
                    for values in fn(name, path):
                        row(values)
                except Exception as e:  # noqa: BLE001 - report and go on to the next model
                    log(f"{name}: {type(e).__name__}: {e}")
                    row([name, f"error: {type(e).__name__}: {str(e)[:160]}"])
                    empty_cache()
    if "k" in args.sections:
        header("CUDA kernels for a quantized linear, microseconds", ["M", "K", "N", "kernel", "us"])
        for K, N in ((896, 896), (896, 9728), (4864, 896)):
            for values in kernels(K, N):
                row(values)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
