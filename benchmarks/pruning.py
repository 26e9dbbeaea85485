"""Pruning: what each method costs in perplexity, time and memory, side by side with llm-compressor, and what
structured pruning buys in decode speed; one set of tables per model.

    python benchmarks/pruning.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--samples 64] [--seq-len 512]
                                 [--max-tokens 16384] [--repeats 2] [--no-peer] [--no-structured] [--quick]

Calibration: --samples windows of --seq-len tokens from the built-in calibration split (calibration_samples,
seed 0: the windows `leanlm prune` takes), written once to a safetensors file that both leanlm and the peer read.
Evaluation: leanlm's perplexity on the first --max-tokens of the built-in evaluation split (windows 1024, stride
512, bf16), the same for every row, the peer's models included. Every variant is made in a fresh process (its
peak RSS is its own VmHWM; "prune s" is the method alone, loading and saving left out) and cached under
$LEANLM_CACHE/bench-prune/ with its measurements and perplexity (delete that folder to re-measure).

Settings, the same on both sides: bf16 weights, every decoder projection pruned (embeddings and lm_head dense),
50% per output row or 2:4 along the input dimension. SparseGPT: block 128, dampening 0.01 x mean diag(H), layer
by layer on the outputs of the already pruned layers. leanlm solves qkv, o, gate_up, down in turn inside a block
(sequential=True, its default); llm-compressor 0.14 solves every Linear of a decoder layer on the layer's inputs
(its sequential pipeline); its unstructured mask is one threshold per 128-column block over all rows, leanlm's
is per row. Wanda: |W| * ||X_j||, per row, on the outputs of the pruned earlier layers (both). The peer runs
`oneshot(SparseGPTModifier | WandaPruningModifier, pipeline="sequential", batch_size=8)` in its own virtual
environment (--peer-python; benchmarks/pruning_peer.py).
Structured: `heads`, `neurons` (redundant) and `layers` (block influence) at --target-params 0.9 / 0.75 / 0.6,
no retraining; decode speed of the first model only: `leanlm bench --compile` (64 tokens after 64, batch 1) in a
fresh process per variant, --repeats round-robin rounds, the median. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

err = Console(stderr=True)
PEER_PYTHON = "/work/venvs/llmc/bin/python"
PATTERNS = {"50%": {"sparsity": 0.5}, "2:4": {"pattern": "2:4"}}
METHODS = ("magnitude", "wanda", "sparsegpt", "taylor")
PEER_METHODS = ("wanda", "sparsegpt")
STRUCTURED = ("heads", "neurons", "layers")
TARGETS = (0.9, 0.75, 0.6)


def child(model: str, method: str, options: dict, calibration: str, output: str, threads: int) -> None:
    """In a fresh process: prune with leanlm on the calibration windows of `calibration`, save, print the time."""
    import torch
    from safetensors.torch import load_file

    from leanlm.models.loading import load
    from leanlm.compress.registry import apply
    from leanlm.pipeline import make_config
    from leanlm.compress.sparse.save import save_float
    from leanlm.fetch import atomic_dir
    from leanlm.models.zoo import resolve
    from leanlm.runtime import peak_rss_mb

    torch.set_num_threads(threads)
    config = make_config(method, options)
    net, _ = load(model, "bfloat16", "cpu", progress=False)
    samples = load_file(calibration)["input_ids"] if config.needs_data else None
    start = time.perf_counter()
    apply(net, config, samples=samples)
    seconds = time.perf_counter() - start
    with atomic_dir(Path(output)) as tmp:
        save_float(net, resolve(model), tmp, {"recipe": [{"method": method, **options}]})
    print(json.dumps({"seconds": seconds, "peak_mb": peak_rss_mb()}))  # not wait4's: it carries the parent's peak


def quantize_child(model: str, method: str, options: dict, calibration: str, output: str, threads: int) -> None:
    """In a fresh process: quantize with leanlm on the windows of `calibration` (`method` one step, or steps joined
    by "+", the options for the last: "rotate+gptq"), save, print the time and peak RSS (frontier, codebook)."""
    import torch
    from safetensors.torch import load_file

    from leanlm.compress.quant import format as qformat
    from leanlm.fetch import atomic_dir
    from leanlm.models.loading import load
    from leanlm.models.zoo import resolve
    from leanlm.pipeline import apply_steps, make_config
    from leanlm.runtime import peak_rss_mb

    torch.set_num_threads(threads)
    *before, last = method.split("+")
    configs = [make_config(name, {}) for name in before] + [make_config(last, options)]
    net, _ = load(model, "bfloat16", "cpu", progress=False)
    needs_data = any(getattr(c, "needs_data", False) for c in configs)
    samples = load_file(calibration)["input_ids"] if needs_data else None
    start = time.perf_counter()
    records = apply_steps(net, configs, samples, {})
    seconds = time.perf_counter() - start
    with atomic_dir(Path(output)) as tmp:
        qformat.save(net, records, configs, resolve(model), tmp)
    print(json.dumps({"seconds": seconds, "peak_mb": peak_rss_mb()}))


def distill_child(model: str, source: str, steps: int, output: str, codes: float = 0.0,
                  lr: float | None = None) -> None:
    """In a fresh process: the distill step of `steps` steps on the quantized model `source` (the bf16 `model` its
    teacher; `codes`, `lr`: the step's options, None its default), saved with the recipe of every step (frontier,
    codebook)."""
    from leanlm.compress.quant import format as qformat
    from leanlm.compress.registry import apply
    from leanlm.fetch import atomic_dir
    from leanlm.lowbit.record import RECORD
    from leanlm.models.loading import load
    from leanlm.models.zoo import resolve
    from leanlm.pipeline import make_config
    from leanlm.runtime import peak_rss_mb

    options = {"teacher": model, "steps": steps, **({"codes": codes} if codes else {}), **({"lr": lr} if lr else {})}
    config = make_config("distill", options)
    net, _ = load(source, "bfloat16", "cpu", progress=False)
    start = time.perf_counter()
    apply(net, config)
    seconds = time.perf_counter() - start
    record = json.loads((Path(source) / RECORD).read_text())
    with atomic_dir(Path(output)) as tmp:
        qformat.save(net, record["layers"], [*record["recipe"], config], resolve(model), tmp)
    print(json.dumps({"seconds": seconds, "peak_mb": peak_rss_mb()}))


def measured(cmd: list[str], out: Path) -> dict:
    """Run a process that writes the model `out` and prints {"seconds": ..., "peak_mb": ...} last; keep the
    result next to `out`, so a later run reuses both."""
    record = out.parent / f"{out.name}.json"
    if out.exists() and record.exists():
        return json.loads(record.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    wait_quiet()
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        done = subprocess.run(cmd, stdout=stdout, stderr=stderr, text=True, cwd="/tmp")
        stdout.seek(0), stderr.seek(0)
        if done.returncode:  # the peer logs much to stderr: show the end of it only on failure
            raise RuntimeError(stderr.read().strip()[-2000:])
        result = json.loads(stdout.read().strip().splitlines()[-1])
    record.write_text(json.dumps(result))
    return result


def wait_quiet() -> None:
    """Another job on these two cores asks for quiet while it measures (/tmp/leanlm-quiet)."""
    while Path("/tmp/leanlm-quiet").exists():
        time.sleep(10)


def write_calibration(model: str, samples: int, seq_len: int, path: Path) -> None:
    """`samples` windows of `seq_len` tokens of the built-in calibration split (seed 0: the windows `leanlm prune`
    and `leanlm quantize` take with --samples --seq-len) as `input_ids` in a safetensors file, unless it exists."""
    from safetensors.torch import save_file

    from leanlm.eval.datasets import calibration_samples, load_text
    from leanlm.models.loading import load

    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _, tok = load(model, progress=False)
    ids = calibration_samples(tok.encode(load_text(None, split="calibration")), samples, seq_len)
    save_file({"input_ids": ids.contiguous()}, str(path))


class Bench:
    """One model's variants, made once, in the folder of its calibration setting."""

    def __init__(self, model: str, args):
        from leanlm.fetch import cache_dir

        self.model, self.args = model, args
        self.root = cache_dir() / "bench-prune" / model / f"n{args.samples}x{args.seq_len}"
        self.calibration = self.root / "calibration.safetensors"
        write_calibration(model, args.samples, args.seq_len, self.calibration)

    def leanlm(self, method: str, options: dict, tag: str) -> tuple[Path, dict]:
        out = self.root / f"{method}-{tag}"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", self.model, method, json.dumps(options),
               str(self.calibration), str(out), "--threads", str(self.args.threads)]
        err.print(f"[dim]{self.model}: leanlm {method} {tag}[/]")
        return out, measured(cmd, out)

    def peer(self, method: str, options: dict, tag: str) -> tuple[Path, dict]:
        from leanlm.models.zoo import resolve

        out = self.root / f"llmcompressor-{method}-{tag}"
        pattern = ["--pattern", options["pattern"]] if "pattern" in options else ["--sparsity",
                                                                                  str(options["sparsity"])]
        cmd = [self.args.peer_python, "-P", str(Path(__file__).with_name("pruning_peer.py")),
               str(resolve(self.model)), str(self.calibration), str(out), "--method", method, *pattern,
               "--threads", str(self.args.threads)]  # -P: benchmarks/kernels.py must not shadow `kernels`
        err.print(f"[dim]{self.model}: llm-compressor {method} {tag}[/]")
        return out, measured(cmd, out)

    def perplexity(self, dirs: list[Path]) -> tuple[float, list[float]]:
        """The dense model's perplexity and each directory's, in one process on the same tokens; each is kept
        beside its model, so a later run (one for decode speed, say) reuses them."""
        from leanlm.bench.compare import quality

        records = [self.root / f"{name}.ppl{self.args.max_tokens}.json" for name in ["dense", *(d.name for d in dirs)]]
        if not all(r.exists() for r in records):
            wait_quiet()
            rows = quality(self.model, [str(d) for d in dirs], "bfloat16", "cpu", self.args.max_tokens)
            for record, row in zip(records, rows):
                record.write_text(json.dumps(row.perplexity))
        values = [json.loads(r.read_text()) for r in records]
        return values[0], values[1:]


def mark(ok: bool, text: str) -> str:
    return f"{'[green]pass' if ok else '[red]FAIL'}[/] {text}"


def unstructured_tables(b: Bench) -> list[Table]:
    args = b.args
    methods = [m for m in METHODS if m in args.methods]
    runs = {(m, t): b.leanlm(m, opts, t) for t, opts in PATTERNS.items() for m in methods}
    peers = {} if args.no_peer else {(m, t): b.peer(m, opts, t) for t, opts in PATTERNS.items() for m in PEER_METHODS}
    keys = list(runs) + [("llmc-" + m, t) for m, t in peers]
    dense, ppls = b.perplexity([d for d, _ in runs.values()] + [d for d, _ in peers.values()])
    ppl = dict(zip(keys, ppls))
    gap = {k: p - dense for k, p in ppl.items()}

    def check(method: str, tag: str) -> str:
        if tag == "50%" and method in ("wanda", "sparsegpt"):
            return mark(gap[method, tag] <= gap["magnitude", tag] / 3, "gap <= 1/3 magnitude's")
        if tag == "2:4" and method == "sparsegpt":
            return mark(ppl[method, tag] < min(ppl["magnitude", tag], ppl["wanda", tag]), "beats magnitude, wanda")
        return ""

    table = Table(title=f"{b.model}: unstructured and 2:4 pruning (dense perplexity {dense:.3f} on "
                        f"{args.max_tokens} evaluation tokens; calibration {args.samples} x {args.seq_len})")
    for col in ("pattern", "method", "perplexity", "gap", "gap / magnitude's", "prune s", "peak RSS MB", "target"):
        table.add_column(col, justify="left" if col in ("pattern", "method", "target") else "right")
    checked = {"magnitude", "wanda"} <= set(methods)
    for (m, t), (_, r) in runs.items():
        ratio = f"{gap[m, t] / gap['magnitude', t]:.2f}" if "magnitude" in methods else ""
        table.add_row(t, m, f"{ppl[m, t]:.3f}", f"{gap[m, t]:+.3f}", ratio, f"{r['seconds']:.1f}",
                      f"{r['peak_mb']:.0f}", check(m, t) if checked else "")
    tables = [table]
    if peers:
        side = Table(title=f"{b.model}: leanlm vs llm-compressor 0.14 (same calibration windows, leanlm's perplexity "
                           f"on the same evaluation tokens; dense {dense:.3f})")
        for col in ("pattern", "method", "leanlm ppl", "llm-compressor ppl", "leanlm s", "llm-compressor s",
                    "leanlm MB", "llm-compressor MB", "target"):
            side.add_column(col, justify="left" if col in ("pattern", "method", "target") else "right")
        for (m, t), (_, r) in peers.items():
            ours = runs[m, t][1]
            side.add_row(t, m, f"{ppl[m, t]:.3f}", f"{ppl['llmc-' + m, t]:.3f}", f"{ours['seconds']:.1f}",
                         f"{r['seconds']:.1f}", f"{ours['peak_mb']:.0f}", f"{r['peak_mb']:.0f}",
                         mark(ppl[m, t] <= ppl["llmc-" + m, t] * 1.001, "no worse (0.1%)"))
        tables.append(side)
    return tables


def param_count(path: Path) -> int:
    """Parameters stored in a model directory (a tied lm_head once)."""
    from math import prod

    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(prod(f.get_slice(k).get_shape()) for k in f.keys())


def decode_speeds(where: dict[str, str], repeats: int, threads: int) -> dict[str, dict]:
    """The median (by tok/s) `leanlm bench --compile` result of each model: batch-1 decode, each run a fresh
    process, rounds interleaved."""
    from leanlm.bench.compare import speed

    trials = {name: [] for name in where}
    for trial in range(repeats):  # round-robin: a slow spell of the machine hits every variant
        for name, path in where.items():
            wait_quiet()
            trials[name].append(speed(path, "bfloat16", threads))
            err.print(f"[dim]{trial + 1}/{repeats} {name:30} {trials[name][-1]['tokens_per_s']:6.1f} tok/s[/]")
    return {name: sorted(t, key=lambda r: r["tokens_per_s"])[len(t) // 2] for name, t in trials.items()}


def structured_table(b: Bench, with_speed: bool) -> Table:
    from leanlm.models.zoo import resolve

    runs, failed = {}, {}
    for m in STRUCTURED:
        for t in TARGETS:
            try:
                runs[m, t] = b.leanlm(m, {"target_params": t}, f"p{t}")
            except RuntimeError as e:  # e.g. removing every head but one still keeps more than t
                failed[m, t] = str(e).splitlines()[-1].removeprefix("error: ")
    dense, ppls = b.perplexity([d for d, _ in runs.values()])
    base = resolve(b.model)
    tps = {}
    if with_speed:
        where = {"dense": str(base)} | {f"{m}-{t}": str(d) for (m, t), (d, _) in runs.items()}
        tps = {k: r["tokens_per_s"] for k, r in decode_speeds(where, b.args.repeats, b.args.threads).items()}
    title = f"{b.model}: structured pruning, no retraining (perplexity on {b.args.max_tokens} evaluation tokens"
    title += f"; batch-1 compiled bf16 decode, {b.args.threads} threads, median of {b.args.repeats} rounds)" \
        if with_speed else ")"
    table = Table(title=title)
    for col in ("method", "params kept", "params M", "perplexity", "gap", "decode tok/s", "vs dense", "prune s",
                "peak RSS MB"):
        table.add_column(col, justify="left" if col == "method" else "right")
    n0 = param_count(base)
    speed = lambda key: (f"{tps[key]:.1f}", f"{tps[key] / tps['dense']:.2f}x") if tps else ("", "")
    table.add_row("dense", "100%", f"{n0 / 1e6:.1f}", f"{dense:.3f}", "", *speed("dense"), "", "")
    for ((m, t), (d, r)), p in zip(runs.items(), ppls):
        n = param_count(d)
        table.add_row(m, f"{n / n0:.1%}", f"{n / 1e6:.1f}", f"{p:.3f}", f"{p - dense:+.3f}", *speed(f"{m}-{t}"),
                      f"{r['seconds']:.1f}", f"{r['peak_mb']:.0f}")
    for (m, t), why in failed.items():
        table.add_row(m, f"{t:.0%} asked", "", f"[dim]{why}[/]")
    return table


def compact_24_w8(b: Bench) -> Table:
    """2:4 SparseGPT + W8 stored compactly (int8_24_gemv) vs the dense W8 model (RTN int8 per channel): decode
    tok/s and perplexity of each, and the same 2:4 model stored as plain int8 (--no-compact: what the sparsity
    alone buys without the kernel). Made by the CLI a user runs, on the same calibration windows."""
    calib = ["--samples", str(b.args.samples), "--seq-len", str(b.args.seq_len)]
    variants = {"dense W8 (rtn)": ["quantize", b.model, "--method", "rtn", "--bits", "8"],
                "2:4 sparsegpt W8, int8 layout": ["prune", b.model, "--method", "sparsegpt", "--pattern", "2:4",
                                                  "--bits", "8", "--no-compact", *calib],
                "2:4 sparsegpt W8, compact": ["prune", b.model, "--method", "sparsegpt", "--pattern", "2:4",
                                              "--bits", "8", "--compact", *calib]}
    dirs = {}
    for i, (name, cmd) in enumerate(variants.items()):
        dirs[name] = out = b.root / f"w8-{i}"
        if not out.exists():
            wait_quiet()
            err.print(f"[dim]{b.model}: leanlm {' '.join(cmd[:1] + cmd[2:])}[/]")
            env = os.environ | {"OMP_NUM_THREADS": str(b.args.threads)}
            subprocess.run([sys.executable, "-m", "leanlm.cli", *cmd, "-o", str(out)], check=True,
                           stdout=sys.stderr, env=env)
    _, ppls = b.perplexity(list(dirs.values()))
    threads = [int(t) for t in b.args.compact_threads.split(",")]
    runs = {t: decode_speeds({k: str(d) for k, d in dirs.items()}, b.args.repeats, t) for t in threads}
    table = Table(title=f"{b.model}: 2:4 + W8 stored compactly vs dense W8 (batch-1 compiled decode, median of "
                        f"{b.args.repeats} rounds; perplexity on {b.args.max_tokens} tokens)")
    for col in ("variant", "weights read MB", "bytes limit", *(f"{t} thread(s) tok/s" for t in threads),
                *(f"{t} thread(s) vs dense W8" for t in threads), "perplexity"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, p in zip(dirs, ppls):
        base, r = runs[threads[0]]["dense W8 (rtn)"], runs[threads[0]][name]
        ratios = [runs[t][name]["tokens_per_s"] / runs[t]["dense W8 (rtn)"]["tokens_per_s"] for t in threads]
        table.add_row(name, f"{r['weight_bytes'] / 2**20:.0f}", f"{base['weight_bytes'] / r['weight_bytes']:.2f}x",
                      *(f"{runs[t][name]['tokens_per_s']:.1f}" for t in threads), *(f"{x:.2f}x" for x in ratios),
                      f"{p:.3f}")
    return table


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":  # one pruning run, in its own process (see Bench.leanlm)
        _, _, model, method, options, calibration, output, _, threads = sys.argv
        from leanlm.errors import LeanLMError

        try:
            return child(model, method, json.loads(options), calibration, output, int(threads))
        except LeanLMError as e:
            sys.exit(f"error: {e}")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--methods", default=",".join(METHODS), help="unstructured methods (magnitude and wanda are "
                                                                 "needed for the checks)")
    ap.add_argument("--samples", type=int, default=64, help="calibration windows")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    ap.add_argument("--max-tokens", type=int, default=16384, help="evaluation tokens")
    ap.add_argument("--threads", type=int, default=1, help="of every pruning and decode process: on two shared "
                    "cores, two OpenMP threads collapse (SparseGPT's column loop ran 10-25x slower) while another "
                    "process runs")
    ap.add_argument("--repeats", type=int, default=2, help="decode-speed rounds (the median is shown)")
    ap.add_argument("--peer-python", default=PEER_PYTHON, help="python of llm-compressor's virtual environment")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--no-unstructured", action="store_true", help="skip the unstructured and 2:4 tables")
    ap.add_argument("--no-structured", action="store_true")
    ap.add_argument("--no-compact", action="store_true", help="skip 2:4 + W8 compact vs dense W8 (first model)")
    ap.add_argument("--compact-threads", default="1,2", help="decode threads of the compact comparison (at 2 the "
                                                               "dense kernel is bound by the shared bandwidth)")
    ap.add_argument("--no-speed", action="store_true", help="structured: perplexity only, no decode speed")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 x 256 calibration, 2048 evaluation "
                                                         "tokens, one speed round")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.seq_len, args.max_tokens, args.repeats = 8, 256, 2048, 1
    args.methods = args.methods.split(",")
    import torch

    torch.set_num_threads(args.threads)  # perplexity runs in this process
    out = Console(width=180)
    for i, model in enumerate(args.models.split(",")):
        b = Bench(model, args)
        for table in [] if args.no_unstructured else unstructured_tables(b):
            out.print(table)
        if not args.no_structured:
            out.print(structured_table(b, with_speed=i == 0 and not args.no_speed))
        if not args.no_compact and i == 0:
            out.print(compact_24_w8(b))


if __name__ == "__main__":
    main()
