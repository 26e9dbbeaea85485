"""`leanlm analyze`: per-op FLOPs, bytes and arithmetic intensity against this machine's roofline."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer
from rich.table import Table

from leanlm.analysis import roofline as rl
from leanlm.bench.probe import peaks
from leanlm.cli.common import DType, Device, Model, Threads, _fail, app, err, out
from leanlm.models.loading import load
from leanlm.runtime import matmul_dtype, set_threads

MB = 2**20


def _hidden_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if len(set(sizes)) < 3 or min(sizes) < 1:
        _fail(f"--hidden-sizes must be at least 3 distinct positive integers separated by commas, got {text!r}")
    return sizes


def _op_table(title: str, costs, ridge: float, critical: dict | None) -> Table:
    table = Table(title=title)
    for col, justify in (("op", "left"), ("FLOPs", "left"), ("GFLOP", "right"), ("bytes", "left"), ("MB", "right"),
                         ("FLOP/B", "right"), ("bound", "left")):
        table.add_column(col, justify=justify)
    if critical is not None:
        table.add_column("compute-bound from batch", justify="right")
    for c in costs:
        row = [rl.LABELS[c.op], c.flops_formula, f"{c.flops / 1e9:.3f}", c.bytes_formula, f"{c.bytes / MB:.2f}",
               f"{c.intensity:.2f}", "compute" if c.intensity >= ridge else "memory"]
        table.add_row(*row, *([] if critical is None else [_batch_text(critical[c.op])]))
    flops, nbytes = rl.total(costs)
    table.add_row("total", "", f"{flops / 1e9:.3f}", "", f"{nbytes / MB:.2f}", f"{flops / nbytes:.2f}",
                  "compute" if flops / nbytes >= ridge else "memory",
                  *([] if critical is None else [_batch_text(critical["total"])]), style="bold")
    return table


def _batch_text(b: int | None) -> str:
    return "never" if b is None else str(b)


@app.command()
def analyze(
    model: Model,
    seq_len: Annotated[int, typer.Option(help="prompt tokens of the prefill, and the context length of the decode "
                                              "step (at most the model's context window)")] = 512,
    batch: Annotated[int, typer.Option(help="sequences per forward")] = 1,
    json_: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    plot: Annotated[Optional[Path], typer.Option(help="write the roofline plot of every op to this PNG file")] = None,
    sweep_hidden: Annotated[bool, typer.Option("--sweep-hidden", help="also time qkv, out, ff1, ff2 on random "
                                               "weights across --hidden-sizes and fit latency(h) = a·h² + b·h + c "
                                               "per op (batch x seq-len tokens, the model's compute dtype)")] = False,
    hidden_sizes: Annotated[str, typer.Option(help="comma-separated hidden sizes for --sweep-hidden")]
    = "256,512,768,1024,1536,2048",
    bandwidth: Annotated[Optional[float], typer.Option(help="peak memory bandwidth in GB/s to use instead of this "
                                                            "machine's (measured by the probe)")] = None,
    gflops: Annotated[Optional[float], typer.Option(help="peak matmul GFLOP/s to use instead of this machine's "
                                                         "(measured by the probe)")] = None,
    refresh_probe: Annotated[bool, typer.Option(help="re-measure the machine's peak bandwidth and FLOP/s")] = False,
    dtype: DType = "auto", device: Device = "auto", threads: Threads = None,
) -> None:
    """Per-op FLOPs, bytes and FLOP/byte of MODEL's prefill and decode step against this machine's roofline, the
    batch at which decode turns compute-bound, memory formulas next to measured sizes (leanlm.analysis.roofline)."""
    for name, value in (("seq-len", seq_len), ("batch", batch)):
        if value < 1:
            _fail(f"--{name} must be at least 1")
    sizes = _hidden_sizes(hidden_sizes) if sweep_hidden else []
    if plot is not None and plot.suffix.lower() != ".png":
        _fail(f"--plot writes a PNG; give a path ending in .png, not {plot}")
    net, _ = load(model, dtype, device, progress=not json_)
    cfg = net.config
    if seq_len > cfg.max_position:
        _fail(f"--seq-len {seq_len} exceeds the model's context window ({cfg.max_position})")
    if threads is not None:
        set_threads(threads)
    threads = torch.get_num_threads()
    compute = matmul_dtype(net.dtype, net.device)
    compute_name = str(compute).removeprefix("torch.")
    if bandwidth is None or gflops is None:
        peak = peaks(net.device.type, threads, refresh=refresh_probe)
        bandwidth = peak.bandwidth_gbs if bandwidth is None else bandwidth
        gflops = peak.matmul_gflops.get(compute_name, peak.matmul_gflops["float32"]) if gflops is None else gflops
    if bandwidth <= 0 or gflops <= 0:
        _fail("--bandwidth and --gflops must be positive")
    ridge = rl.ridge_point(gflops, bandwidth)

    sizes_kw = dict(act_bytes=net.dtype.itemsize, weight_bytes=rl.weight_bytes_per_element(net),
                    kv_bytes=net.dtype.itemsize)
    costs = {phase: rl.op_costs(cfg, phase, batch, seq_len, **sizes_kw) for phase in rl.PHASES}
    critical = {op: rl.decode_compute_bound_batch(cfg, seq_len, ridge, op, **sizes_kw) for op in rl.OPS}
    critical["total"] = rl.decode_compute_bound_batch(cfg, seq_len, ridge, **sizes_kw)
    meta = rl.meta_transformer(cfg)
    checks = {}
    for phase in rl.PHASES:  # flop_counter counts the full attention square: compare with that convention
        full = rl.op_costs(cfg, phase, batch, seq_len, causal=False, **sizes_kw)
        checks[phase] = {"formula": rl.formula_by_counted_op(full),
                         "flop_counter": rl.counted_flops(meta, phase, batch, seq_len)}
    memory = rl.memory_rows(net, batch, seq_len)
    sweep = None
    if sweep_hidden:
        err.print(f"timing qkv, out, ff1, ff2 at hidden sizes {sizes} ({batch * seq_len} tokens, {compute_name})")
        times = rl.sweep_hidden(sizes, batch * seq_len, compute, str(net.device))
        sweep = {"hidden_sizes": sizes, "tokens": batch * seq_len, "dtype": compute_name, "seconds": times,
                 "fit": {op: dict(zip("abc", rl.fit_quadratic(sizes, ts))) for op, ts in times.items()}}
    title = (f"{model} · {str(net.dtype).removeprefix('torch.')} · batch {batch} · seq-len {seq_len} · "
             f"{bandwidth:.1f} GB/s, {gflops:.0f} GFLOP/s ({compute_name} matmul) → ridge {ridge:.1f} FLOP/byte")
    if plot is not None:
        rl.plot_roofline(costs["prefill"] + costs["decode"], gflops, bandwidth, plot, title)

    if json_:
        print(json.dumps({
            "model": model, "dtype": str(net.dtype).removeprefix("torch."), "batch": batch, "seq_len": seq_len,
            "threads": threads, "bandwidth_gbs": bandwidth, "peak_gflops": gflops, "compute_dtype": compute_name,
            "ridge": ridge, **{phase: [c.to_dict() for c in costs[phase]] for phase in rl.PHASES},
            "totals": {phase: dict(zip(("flops", "bytes"), rl.total(costs[phase]))) for phase in rl.PHASES},
            "decode_compute_bound_batch": critical, "flop_check": checks,
            "memory": [asdict(r) for r in memory], "sweep": sweep, "plot": str(plot) if plot else None}))
        return
    out.print(title)
    out.print("d hidden, q = H·D, kv = Hkv·D, I intermediate, V vocab, L layers, T prompt tokens, S context; wb, ab, "
              "kb: bytes per weight, activation, cached value. Matmul FLOPs only (2·M·N·K), prefill attention causal "
              "(T(T+1)/2 pairs), fused (scores stay on chip), logits of the last position.")
    out.print(_op_table(f"prefill: {batch} x {seq_len} tokens", costs["prefill"], ridge, None))
    out.print(_op_table(f"decode: one token per sequence at context {seq_len}", costs["decode"], ridge, critical))
    b = critical["total"]
    out.print(f"decode at context {seq_len} turns compute-bound at batch {b}" if b is not None else
              f"decode at context {seq_len} stays memory-bound at any batch: each sequence's KV reads cost more "
              f"bytes per FLOP than the ridge ({ridge:.1f} FLOP/byte) allows")
    for phase, check in checks.items():
        formula, counted = sum(check["formula"].values()), sum(check["flop_counter"].values())
        out.print(f"{phase}: torch.utils.flop_counter on the same forward counts {counted / 1e9:.4f} GFLOP; the formulas "
                  f"give {formula / 1e9:.4f} with attention's full square, as flop_counter counts it"
                  + ("" if formula == counted else " [bold red](differs)[/]"))
    table = Table("quantity", "formula", "by formula", "measured", title="memory (MB; parameters in millions)")
    for r in memory:
        scale = 1e6 if r.quantity == "parameters" else MB
        table.add_row(r.quantity, r.formula, f"{r.by_formula / scale:,.2f}",
                      "" if r.measured is None else f"{r.measured / scale:,.2f}")
    out.print(table)
    if sweep:
        table = Table("hidden", *(f"{op} ms" for op in rl.SWEEP_OPS),
                      title=f"latency per op on random weights, {sweep['tokens']} tokens, {compute_name} "
                            "(qkv h→3h, out h→h, ff1 h→4h, ff2 4h→h)")
        for i, h in enumerate(sizes):
            table.add_row(str(h), *(f"{sweep['seconds'][op][i] * 1e3:.3f}" for op in rl.SWEEP_OPS))
        for name, unit in (("a", "ms per h²"), ("b", "ms per h"), ("c", "ms")):
            table.add_row(f"fit {name}, {unit}", *(f"{sweep['fit'][op][name] * 1e3:.3g}" for op in rl.SWEEP_OPS))
        out.print(table)
    if plot is not None:
        err.print(f"roofline plot: {plot}")
