"""Per-op FLOPs, bytes and arithmetic intensity of a decoder's prefill and decode step, against a roofline.

Roofline model: https://doi.org/10.1145/1498765.1498785 . Conventions (the lectures' per-op tables):

- FLOPs are matmul FLOPs only, 2*M*N*K per product (a multiply and an add). Norms, RoPE, softmax, SiLU, residual
  adds and biases are O(tokens x width) and left out, as torch.utils.flop_counter leaves them out.
- Attention counts query-key pairs: QK^T and softmax.V each cost 2*D FLOPs per pair and query head (with GQA every
  query head still does its own products; only K/V storage is shared). A prefill of T tokens from an empty cache is
  causal, T(T+1)/2 pairs per head (`causal=True`: the work of a kernel that skips masked blocks); `causal=False`
  counts the full T^2 square, which is what flop_counter (and a dense kernel) counts. A decode step at context S
  (the new token attends to S positions, itself included) has S pairs per head either way.
- Bytes are the least one op moves: its weights at their stored bytes per element, its input and output
  activations, and the K/V it reads (num_kv_heads x head_dim per position, so GQA reads H/Hkv times less than MHA).
  Attention is taken as fused (flash-style): the scores never reach memory.
- Prefill computes the logits of the last position only, as leanlm's prefill does (`logits_all=True`: every one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from leanlm.analysis.memory import activation_bytes, formula_weight_bytes, kv_cache_bytes, param_count, stored_bytes
from leanlm.analysis.report import PeakTensorBytes
from leanlm.cache.static import StaticCache
from leanlm.errors import LeanLMError
from leanlm.models.config import ModelConfig
from leanlm.models.transformer import Transformer
from leanlm.runtime import best_seconds

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
OPS = ("qkv_proj", "o_proj", "qk", "pv", "gate_up_proj", "down_proj", "lm_head")
LABELS = {"qkv_proj": "q/k/v proj", "o_proj": "o proj", "qk": "QKᵀ", "pv": "softmax·V", "gate_up_proj": "MLP gate/up",
          "down_proj": "MLP down", "lm_head": "lm_head"}
PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class OpCost:
    """One op summed over the layers it runs in: FLOPs, bytes moved, and the formulas that gave them."""

    op: str  # a key of LABELS
    phase: str  # "prefill" or "decode"
    flops: float
    bytes: float
    flops_formula: str
    bytes_formula: str

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte."""
        return self.flops / self.bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "label": LABELS[self.op], "intensity": self.intensity}


def op_costs(cfg: ModelConfig, phase: str, batch: int, seq_len: int, *, act_bytes: float = 2.0,
             weight_bytes: float | Mapping[str, float] = 2.0, kv_bytes: float | None = None, causal: bool = True,
             logits_all: bool = False) -> list[OpCost]:
    """The ops of one forward, in OPS order: prefill of `seq_len` tokens per sequence, or one decode step at context
    `seq_len`, for `batch` sequences. `weight_bytes`: bytes per weight element, one number or one per projection
    (PROJECTIONS; weight_bytes_per_element measures a model's); `kv_bytes`: per cached value (default act_bytes)."""
    if phase not in PHASES:
        raise LeanLMError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
    if batch < 1 or seq_len < 1:
        raise LeanLMError(f"batch and seq_len must be at least 1, got {batch} and {seq_len}")
    kb = act_bytes if kv_bytes is None else kv_bytes
    B, L, d, I, V = batch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, kv = cfg.q_size, cfg.kv_size
    T, M = (seq_len, "B·T") if phase == "prefill" else (1, "B")
    S = seq_len  # keys each new token's query sees at most
    if phase == "prefill" and causal:
        pairs, P = T * (T + 1) // 2, "T(T+1)/2"
    else:
        pairs, P = T * S, "T²" if phase == "prefill" else "S"

    def wb(op: str) -> float:
        return weight_bytes[op] if isinstance(weight_bytes, Mapping) else weight_bytes

    def linear(op: str, rows: int, k: int, n: int, layers: int, shape: str, rows_name: str) -> OpCost:
        # [rows, k] @ [k, n]: weights read once, activations in and out
        moved = f"{shape}·wb + {rows_name}·({shape.replace('·', '+')})·ab"  # weights + input [rows, k] + output
        return OpCost(op, phase, layers * 2 * rows * k * n, layers * (n * k * wb(op) + rows * (k + n) * act_bytes),
                      f"{'L·' if layers > 1 else ''}2·{rows_name}·{shape}", f"L·({moved})" if layers > 1 else moved)

    head_rows = B * (T if logits_all else 1)
    attn_flops = L * 2 * B * H * pairs * D
    q_or_o = B * H * T * D * act_bytes  # this step's queries in (QKᵀ) or attention outputs out (softmax·V)
    keys = B * Hkv * S * D * kb  # the K (or V) cache this step reads, new positions included
    Q, K = ("B·H·T", "B·Hkv·T") if phase == "prefill" else ("B·H", "B·Hkv·S")
    return [
        linear("qkv_proj", B * T, d, q + 2 * kv, L, "d·(q+2kv)", M),
        linear("o_proj", B * T, q, d, L, "q·d", M),
        OpCost("qk", phase, attn_flops, L * (q_or_o + keys), f"L·2·B·H·{P}·D", f"L·({Q}·D·ab + {K}·D·kb)"),
        OpCost("pv", phase, attn_flops, L * (q_or_o + keys), f"L·2·B·H·{P}·D", f"L·({K}·D·kb + {Q}·D·ab)"),
        linear("gate_up_proj", B * T, d, 2 * I, L, "d·2I", M),
        linear("down_proj", B * T, I, d, L, "I·d", M),
        linear("lm_head", head_rows, d, V, 1, "d·V", "B·T" if logits_all and T > 1 else "B"),
    ]


def total(costs: list[OpCost]) -> tuple[float, float]:
    """(FLOPs, bytes) of a list of ops."""
    return sum(c.flops for c in costs), sum(c.bytes for c in costs)


def ridge_point(peak_gflops: float, bandwidth_gbs: float) -> float:
    """FLOP per byte where the roofline bends: below it an op is memory-bound, above it compute-bound."""
    if peak_gflops <= 0 or bandwidth_gbs <= 0:
        raise LeanLMError(f"peaks must be positive, got {peak_gflops} GFLOP/s and {bandwidth_gbs} GB/s")
    return peak_gflops / bandwidth_gbs


def attainable_gflops(intensity: float, peak_gflops: float, bandwidth_gbs: float) -> float:
    """The roof: min(peak, bandwidth x intensity)."""
    return min(peak_gflops, bandwidth_gbs * intensity)


def decode_compute_bound_batch(cfg: ModelConfig, seq_len: int, ridge: float, op: str | None = None,
                               **kwargs) -> int | None:
    """The smallest batch at which one decode step at context `seq_len` (or its op `op`) reaches `ridge` FLOP/byte;
    None when no batch does (every sequence reads its own KV cache, so attention's intensity does not grow with
    batch). kwargs: op_costs' byte sizes. FLOPs grow as B*f and bytes as w + B*a, so B = ridge*w / (f - ridge*a)."""
    def flops_bytes(b: int) -> tuple[float, float]:
        costs = op_costs(cfg, "decode", b, seq_len, **kwargs)
        return total([c for c in costs if op is None or c.op == op])

    f, one = flops_bytes(1)
    a = flops_bytes(2)[1] - one
    w = one - a
    if f - ridge * a <= 0:
        return None
    return max(1, math.ceil(ridge * w / (f - ridge * a) - 1e-9))


def weight_bytes_per_element(model) -> dict[str, float]:
    """Measured stored bytes per weight element of each projection kind (PROJECTIONS), averaged over the layers:
    a float projection's dtype size, a quantized one's codes plus its scales and zero points (biases left out)."""
    stored: dict[str, float] = {}
    elements: dict[str, int] = {}
    for name, m in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind not in PROJECTIONS:
            continue
        tensors = [t for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
                   if n != "bias" and t is not None]
        stored[kind] = stored.get(kind, 0) + sum(t.numel() * t.element_size() for t in tensors)
        elements[kind] = elements.get(kind, 0) + m.in_features * m.out_features
    return {kind: stored[kind] / elements[kind] for kind in stored}


def meta_transformer(cfg: ModelConfig):
    """A float32 Transformer of `cfg` on the meta device: the same forward, shapes only, no memory, no time."""
    with torch.device("meta"):
        return Transformer(cfg)


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """flop_counter's SDPA formula (full square) for the CPU flash kernel, which flop_counter does not register."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


@torch.inference_mode()
def counted_flops(model, phase: str, batch: int, seq_len: int, logits_all: bool = False) -> dict[str, int]:
    """FLOPs that torch.utils.flop_counter counts in one forward of `model` (any device, meta included), by op:
    the projections (PROJECTIONS) and "attention" (QKᵀ and softmax·V together: the fused kernel is one call).
    Phases as in op_costs: a decode step at context `seq_len` first prefills seq_len - 1 tokens, uncounted."""
    if phase not in PHASES:
        raise LeanLMError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
    dev = model.device
    cache = StaticCache(model.config, batch, seq_len + (phase == "prefill"), model.dtype, dev)
    T = seq_len if phase == "prefill" else 1
    if phase == "decode" and seq_len > 1:
        model(torch.zeros(batch, seq_len - 1, dtype=torch.long, device=dev),
              torch.arange(seq_len - 1, device=dev).expand(batch, -1), cache, last_only=True)
    start = cache.length
    counter = FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops})
    with counter:
        model(torch.zeros(batch, T, dtype=torch.long, device=dev),
              torch.arange(start, start + T, device=dev).expand(batch, -1), cache,
              last_only=phase == "prefill" and not logits_all)
    counts = {kind: 0 for kind in (*PROJECTIONS, "attention")}
    for name, by_op in counter.get_flop_counts().items():
        parts = name.split(".")
        n = sum(by_op.values())
        if parts[-1] in PROJECTIONS:
            counts[parts[-1]] += n
        elif parts[-1] == "self_attn":  # the module's total; its projections are taken back out below
            counts["attention"] += n
    counts["attention"] -= counts["qkv_proj"] + counts["o_proj"]
    return counts


def formula_by_counted_op(costs: list[OpCost]) -> dict[str, float]:
    """op_costs' FLOPs grouped as counted_flops groups them (QKᵀ + softmax·V as "attention")."""
    out = {c.op: c.flops for c in costs if c.op in PROJECTIONS}
    out["attention"] = sum(c.flops for c in costs if c.op in ("qk", "pv"))
    return out


@dataclass(frozen=True)
class MemoryRow:
    quantity: str
    formula: str
    by_formula: float  # bytes (a count for "parameters")
    measured: float | None  # None: nothing here to measure it on


@torch.inference_mode()
def memory_rows(model, batch: int, seq_len: int) -> list[MemoryRow]:
    """Textbook memory formulas (analysis.memory) next to what `model` holds: parameters, weights, KV cache as
    configured and as MHA would need it, a prefill's activations, its input ids and output logits."""
    cfg, dev, nbytes = model.config, model.device, model.dtype.itemsize
    counts = param_count(cfg)
    formula_bytes, params = formula_weight_bytes(model)
    quantized = any(hasattr(m, "BITS") for m in model.modules())
    cache = StaticCache(cfg, batch, seq_len, model.dtype, dev)
    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device=dev)
    with PeakTensorBytes() as tracker:
        logits = model(tokens, torch.arange(seq_len, device=dev).expand(batch, -1), last_only=True)
    mha = replace(cfg, num_kv_heads=cfg.num_heads)
    return [
        MemoryRow("parameters", "V·d + L·(d·(q+2kv) + q·d + 3·d·I) + (2L+1)·d (+ V·d untied head)", counts.total,
                  params),
        MemoryRow("weights", "quantized params x bits/8 + the rest x dtype bytes" if quantized else
                  f"parameters x {nbytes} B", formula_bytes if quantized else counts.total * nbytes, stored_bytes(model)),
        MemoryRow(f"KV cache {batch} x {seq_len} ({cfg.num_kv_heads} KV heads)", f"2·L·Hkv·D·{nbytes} B·B·S",
                  kv_cache_bytes(cfg, batch, seq_len, nbytes), cache.nbytes),
        MemoryRow(f"KV cache if MHA ({cfg.num_heads} KV heads)", f"2·L·H·D·{nbytes} B·B·S",
                  kv_cache_bytes(mha, batch, seq_len, nbytes), None),
        MemoryRow(f"activations, prefill {batch} x {seq_len}", f"B·T·((2d + max(2q+2kv, 3I))·{nbytes} B + 2d·4 B) "
                  "+ B·V·4 B", activation_bytes(cfg, batch, seq_len, nbytes), tracker.peak),
        MemoryRow("input ids", "B·T·8 B (int64)", batch * seq_len * 8, tokens.nbytes),
        MemoryRow("output logits (last position)", f"B·V·{nbytes} B", batch * cfg.vocab_size * nbytes, logits.nbytes),
    ]


def plot_roofline(costs: list[OpCost], peak_gflops: float, bandwidth_gbs: float, path, title: str = "") -> None:
    """Write a log-log roofline PNG: the roof min(peak, bandwidth x I), each op at its intensity on it."""
    # matplotlib: heavy, only --plot needs it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ridge = ridge_point(peak_gflops, bandwidth_gbs)
    xs = [c.intensity for c in costs] + [ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig = Figure(figsize=(10, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.loglog(grid, [attainable_gflops(x, peak_gflops, bandwidth_gbs) for x in grid], color="black", lw=1.5,
              label=f"roof: {bandwidth_gbs:.1f} GB/s, {peak_gflops:.0f} GFLOP/s")
    ax.axvline(ridge, color="grey", ls=":", lw=1, label=f"ridge {ridge:.1f} FLOP/B")
    colors = {op: f"C{i}" for i, op in enumerate(OPS)}  # one colour per op, one marker per phase
    for phase, marker in (("prefill", "o"), ("decode", "s")):
        for c in (c for c in costs if c.phase == phase):
            ax.scatter([c.intensity], [attainable_gflops(c.intensity, peak_gflops, bandwidth_gbs)], marker=marker,
                       s=45, color=colors[c.op], edgecolors="black", linewidths=0.5, zorder=3,
                       label=f"{LABELS[c.op]}, {phase} ({c.intensity:.1f})")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable GFLOP/s")
    ax.set_title(title or "roofline", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7, title="○ prefill, □ decode", title_fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SWEEP_OPS = ("qkv", "out", "ff1", "ff2")


def sweep_shapes(h: int, ff_mult: int = 4) -> dict[str, tuple[int, int]]:
    """(in, out) features of each op of a plain MHA block of width h: qkv h->3h, out h->h, ff1 h->4h, ff2 4h->h."""
    return {"qkv": (h, 3 * h), "out": (h, h), "ff1": (h, ff_mult * h), "ff2": (ff_mult * h, h)}


def sweep_hidden(hidden_sizes: list[int], tokens: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 reps: int = 3, seed: int = 0) -> dict[str, list[float]]:
    """Seconds per op (SWEEP_OPS) of x [tokens, in] @ W [in, out] on random weights, best of `reps`, per hidden
    size: {op: [seconds at hidden_sizes[0], ...]}."""
    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    times: dict[str, list[float]] = {op: [] for op in SWEEP_OPS}
    with torch.inference_mode():
        for h in hidden_sizes:
            for op, (k, n) in sweep_shapes(h).items():
                x = torch.randn(tokens, k, generator=gen).to(dev, dtype)
                w = torch.randn(n, k, generator=gen).to(dev, dtype)
                times[op].append(best_seconds(lambda: F.linear(x, w), dev, reps))
    return times


def fit_quadratic(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares (a, b, c) of y = a*x^2 + b*x + c; needs three distinct x."""
    if len(set(xs)) < 3:
        raise LeanLMError(f"a quadratic fit needs at least 3 distinct sizes, got {sorted(set(xs))}")
    x = torch.tensor(xs, dtype=torch.float64)
    A = torch.stack([x * x, x, torch.ones_like(x)], dim=1)  # [n, 3]
    sol = torch.linalg.lstsq(A, torch.tensor(ys, dtype=torch.float64)[:, None], driver="gelsd").solution
    a, b, c = sol[:, 0].tolist()
    return a, b, c
