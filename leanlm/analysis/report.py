"""`leanlm info`: architecture and memory breakdown, formula next to measurement."""

from __future__ import annotations

import weakref

import torch
from rich.console import Group
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from leanlm.analysis.memory import (activation_bytes, formula_weight_bytes, kv_cache_bytes, lm_head_kind, param_count,
                                    stored_bytes, weight_bytes_read)
from leanlm.cache.static import StaticCache
from leanlm.compress.sparse.masks import decoder_sparsity, module_sparsity
from leanlm.models.transformer import Transformer

MB = 2**20


class PeakTensorBytes(TorchDispatchMode):
    """Measures the peak bytes of tensors created inside the block (and still alive), on any device."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
                if n and key not in self._seen:
                    self._seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, n)
        return result

    def _free(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n


def _count(model: Transformer, *names: str) -> int:
    """Parameters under the named modules; a quantized projection counts its in x out (+ bias) weights."""
    params = {id(p): p.numel() for n, p in model.named_parameters() if any(s in n for s in names)}
    for n, m in model.named_modules():
        if hasattr(m, "BITS") and any(s in n + "." for s in names):
            params[id(m)] = m.in_features * m.out_features + (0 if m.bias is None else m.out_features)
    return sum(params.values())


@torch.inference_mode()
def memory_report(model: Transformer, batch: int = 1, length: int | None = None, disk: int | None = None) -> Group:
    """Architecture, memory by formula next to measured (`disk`: the bytes of the model's files, when known), and
    the sparsity of each projection when the model is pruned."""
    cfg = model.config
    length = min(length or cfg.max_position, cfg.max_position)
    nbytes = model.dtype.itemsize
    counts = param_count(cfg)
    arch = Table("architecture", "", show_header=False)
    for k, v in cfg.to_dict().items():
        arch.add_row(k, str(v))
    arch.add_row("lm_head", lm_head_kind(model))

    cache = StaticCache(cfg, batch, length, model.dtype, model.device)
    prefill = min(length, 512)
    with PeakTensorBytes() as tracker:
        model(torch.zeros(1, prefill, dtype=torch.long, device=model.device),
              torch.arange(prefill, device=model.device)[None], last_only=True)

    mem = Table("quantity", "formula", "formula", "measured", title=f"memory ({str(model.dtype)[6:]})")
    rows = [
        ("embedding params", "V x d", counts.embedding, _count(model, "embed_tokens")),
        ("attention params", "L x (d x (q + 2kv) + q x d) (+ biases)", counts.attention, _count(model, "self_attn")),
        ("MLP params", "L x 3 x d x I", counts.mlp, _count(model, "mlp.")),
        ("norm params", "(2L + 1) x d", counts.norms, _count(model, "norm")),
        ("lm_head params", "0 if tied else V x d", counts.lm_head,
         0 if cfg.tie_embeddings else _count(model, "lm_head")),
    ]
    for name, formula, value, measured in rows:
        mem.add_row(name, formula, f"{value:,}", f"{measured:,}")
    mem.add_row("weights MB", f"params x {nbytes} B", f"{counts.total * nbytes / MB:,.1f}",
                f"{stored_bytes(model) / MB:,.1f}")
    if any(hasattr(m, "BITS") for m in model.modules()):
        formula, params = formula_weight_bytes(model)
        mem.add_row("quantized weights MB", "quantized params x bits / 8 + the rest x dtype bytes (scales included)",
                    f"{formula / MB:,.1f}", f"{stored_bytes(model) / MB:,.1f}")
        mem.add_row("bits per weight", "", f"{formula * 8 / params:.2f}", f"{stored_bytes(model) * 8 / params:.2f}")
    if disk is not None:
        mem.add_row("weights on disk MB", "the files as stored", "", f"{disk / MB:,.1f}")
    mem.add_row("read per decode step MB", "weights - untied embedding", f"{counts.read_per_token * nbytes / MB:,.1f}",
                f"{weight_bytes_read(model) / MB:,.1f}")
    mem.add_row(f"KV cache MB, {batch} x {length}", f"2 x L x kv_heads x head_dim x {nbytes} B x batch x length",
                f"{kv_cache_bytes(cfg, batch, length, nbytes) / MB:,.1f}", f"{cache.nbytes / MB:,.1f}")
    mem.add_row(f"activations MB, prefill 1 x {prefill}",
                f"T x ((2d + max(2q + 2kv, 3I)) x {nbytes} B + 2d x 4 B) + V x 4 B",
                f"{activation_bytes(cfg, 1, prefill, nbytes) / MB:,.1f}", f"{tracker.peak / MB:,.1f}")
    sparse = sparsity_table(model)
    return Group(arch, mem) if sparse is None else Group(arch, mem, sparse)


def sparsity_table(model: Transformer, least: float = 0.05) -> Table | None:
    """Per block, the fraction of each projection's weights pruned to zero (masks.module_sparsity); None for a
    model not pruned (no projection with at least `least` of its weights pruned)."""
    rows: dict[int, dict[str, float]] = {}
    for name, m in model.named_modules():
        if name.startswith("layers.") and hasattr(m, "in_features"):
            _, block, _, proj = name.split(".")
            rows.setdefault(int(block), {})[proj] = module_sparsity(m)
    if not rows or max(max(r.values()) for r in rows.values()) < least:
        return None
    projs = list(rows[min(rows)])
    zeros, pattern = decoder_sparsity(model)
    table = Table("layer", *projs, title=f"sparsity (fraction of weights that are zero): {zeros:.1%}"
                                         + (f", {pattern}" if pattern else ""))
    for block, r in sorted(rows.items()):
        table.add_row(str(block), *(f"{r[p]:.1%}" for p in projs))
    return table
