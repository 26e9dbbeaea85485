"""Decoder building blocks: RMSNorm, rotary embedding, grouped-query attention, SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leanlm import kernels
from leanlm.lowbit.hadamard import OnlineRotation
from leanlm.lowbit.linear import (PackedW4A8Linear, PackedW8A8Linear, PackedW8A16Linear, W4A8Linear, W8A8Linear,
                                  W8A16Linear, like_input)
from leanlm.models.config import ModelConfig
from leanlm.runtime import matmul_dtype


class Linear(nn.Linear):
    """nn.Linear with the kernel picked per phase on CPU.

    - Compiled single row (decode): a plain reduction, which inductor turns into one fused loop that
      streams the weight once (the library bf16 GEMV pays a large fixed cost per call here).
    - A few rows (batched decode, up to kernels.bf16_rows(), measured) of a bf16 weight: leanlm's bf16 kernel,
      which reads each weight row from memory once for all the rows (torch's GEMM fell to 2-14 GB/s at 2-8 rows on
      Zen 4; with AMX it stays near 25 GB/s and wins from a few rows).
    - Several rows (prefill) of a 16-bit weight on a CPU without a GEMM for its dtype (fp16 on x86; bf16 without
      AVX512-BF16 or AMX): the product runs in float32 (runtime.matmul_dtype); the weight stays 16-bit in memory
      because decode reads it whole every token.
    """

    def row_splits(self) -> tuple[int, ...]:
        """Row counts after which forward takes another path (a compiled graph of a symbolic batch size must not
        span one: engine.compiled.row_ranges); one row is always a path of its own."""
        return (kernels.bf16_rows(),) if self.weight.dtype == torch.bfloat16 else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if torch.compiler.is_compiling() and x.numel() == x.shape[-1]:
            y = (x.unsqueeze(-2).float() * w.float()).sum(-1)
            return (y if b is None else y + b.float()).to(x.dtype)
        if kernels.bf16_product(x, w):
            y = kernels.ops().bf16_gemm(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
            return y if b is None else y + b
        if x.numel() > x.shape[-1] and (cdt := matmul_dtype(w.dtype, w.device)) != w.dtype:
            return F.linear(x.to(cdt), w.to(cdt), None if b is None else b.to(cdt)).to(x.dtype)
        return F.linear(x, w, b)


class PackedLinear(nn.Module):
    """A bf16 Linear for inference whose weight is kept only in bf16_packed_gemm's layout (kernels.pack_bf16), for
    every row count: a SmolLM2-135M layer's products from memory 1.8x faster than torch's GEMM at 32 rows (84% of
    its large-GEMM peak), 3.8x at one row, 1.16x at 256 (Zen 4, 2 threads; benchmarks/kernels.py --sections b); on
    a CPU with AMX, AMX tiles on the same layout (bf16_packed_amx: 1.7x torch's GEMM at 32 rows, 1.1x at 256).
    A row's sums run in the same order at any number of rows, so a sequence's logits do not depend on its batch.
    No backward; `weight` unpacks a copy for code that reads it."""

    def __init__(self, linear: nn.Linear, in_place: bool = False):
        """in_place: write the packed layout over the Linear's own weight (which is then no longer [N, K]), so a
        model whose weights share one buffer on huge pages (runtime.empty_on_huge_pages) keeps them there and
        holds no second copy."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        packed = kernels.pack_bf16(w)  # [N/16, K/2, 16, 2]
        self.register_buffer("packed", kernels.write_over(w, packed) if in_place else packed)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    @property
    def weight(self) -> torch.Tensor:
        """The [N, K] weight, unpacked (a copy)."""
        return kernels.unpack_pairs(self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed.dtype != torch.bfloat16 or not self.packed.is_cpu:  # moved or cast since (model.to)
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        x2d = x.reshape(-1, self.in_features)
        x2d = x2d if x.dtype == torch.bfloat16 else x2d.to(torch.bfloat16)
        if kernels.amx() and self.in_features % 32 == 0:  # AMX tiles on the same layout, faster at any row count
            y = kernels.ops().bf16_packed_amx(x2d.contiguous(), self.packed)
        else:
            y = kernels.ops().bf16_packed_gemm(x2d, self.packed)
        y = like_input(y, x, self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedEmbedding(nn.Module):
    """The embedding of a tied pair whose lm_head is a PackedLinear: the table [V, hidden] read from that packed
    weight (token t: tile t // 16, lane t % 16 of each pair of columns), so the pair keeps one copy."""

    def __init__(self, packed: torch.Tensor):
        super().__init__()
        self.num_embeddings, self.embedding_dim = packed.shape[0] * 16, packed.shape[1] * 2
        self.register_buffer("packed", packed)  # [V/16, hidden/2, 16, 2], the lm_head's own

    @property
    def weight(self) -> torch.Tensor:
        """The [V, hidden] table, unpacked (a copy)."""
        return kernels.unpack_pairs(self.packed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.packed[tokens // 16, :, tokens % 16].reshape(*tokens.shape, self.embedding_dim)


def pack_linears(model: nn.Module) -> int:
    """Swap an inference model's layers on this CPU for their packed counterparts where the kernels' vector loops
    run and the shapes pack: bf16 Linear for PackedLinear (AVX512-BF16 or AVX2; out_features % 16 ==
    in_features % 2 == 0), W8A16Linear for PackedW8A16Linear and W8A8Linear for PackedW8A8Linear (AVX-512 VNNI or
    AVX2; W8A8: % 16, % 4, in_features <= 32768, where the int32 sums are exact) and W4A8Linear for PackedW4A8Linear
    (AVX-512 VNNI). A Linear tied to an nn.Embedding (an lm_head) is packed with it: the embedding becomes a
    PackedEmbedding of the same packed weight. Each weight is packed in its own memory. Returns how many Linears were
    swapped."""
    ops = kernels.ops()
    if ops is None:
        return 0
    bf16, vnni, simd = kernels.packed_bf16(), ops.isa() == "avx512", ops.isa() in ("avx512", "avx2")
    tied = {id(m.weight): (parent, name) for parent in model.modules() for name, m in parent.named_children()
            if type(m) is nn.Embedding}
    shared = {id(p) for m in model.modules() if not isinstance(m, Linear) for p in m.parameters(recurse=False)}
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            N, K = getattr(child, "out_features", 0), getattr(child, "in_features", 0)
            w = child.weight_packed if type(child) is W4A8Linear else getattr(child, "weight", None)
            if not (N % 16 == 0 and K % 2 == 0 and w is not None and w.is_cpu):
                continue
            if bf16 and type(child) is Linear and w.dtype == torch.bfloat16 and (id(w) not in shared or id(w) in tied):
                packed = PackedLinear(child, in_place=True)
                setattr(parent, name, packed)
                if id(w) in tied:
                    setattr(*tied[id(w)], PackedEmbedding(packed.packed))
            elif simd and type(child) is W8A8Linear and K % 4 == 0 and K <= 32768:
                setattr(parent, name, PackedW8A8Linear(child, in_place=True))
            elif simd and type(child) is W8A16Linear:
                setattr(parent, name, PackedW8A16Linear(child, in_place=True))
            elif vnni and type(child) is W4A8Linear and K % 8 == 0 and child.group_size % 8 == 0:
                setattr(parent, name, PackedW4A8Linear(child, in_place=True))
            else:
                continue
            swapped += 1
    return swapped


def fused_ops(x: torch.Tensor, *params: torch.Tensor):
    """leanlm's kernels where its fused elementwise ops apply to x (and these weights): bf16 on the CPU, eager (a
    compiled graph fuses the torch code itself), no autograd; else None."""
    if x.dtype != torch.bfloat16 or not x.is_cpu or torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return None
    return kernels.ops()


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in float32 like the reference implementations (one kernel op in eager bf16)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        D = x.shape[-1]
        if D % 16 == 0 and self.weight.dtype == torch.bfloat16 and (ops := fused_ops(x, self.weight)) is not None:
            return ops.rms_norm(x.reshape(-1, D), self.weight, self.eps).view(x.shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_table(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for every position, half-split layout (rotate_half convention)  # [max_position, head_dim]"""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device=device) / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.max_position, dtype=torch.float64, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + D/2) of every head.  x [B, T, H, D]; cos, sin [B, T, 1, D]"""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * cos, rotated, sin)


class Attention(nn.Module):
    """Grouped-query attention with one fused q/k/v projection.  https://arxiv.org/abs/2305.13245"""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache, mask, is_causal):
        """x [B, T, hidden] -> [B, T, hidden]. With a cache (cache.base.KVCache), it stores this step's keys and
        values and attends; without one, the T tokens attend to each other (mask, is_causal as the cache's
        attention_mask would give them)."""
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
        D, rotated = self.head_dim, self.n_heads + self.n_kv
        fits = D % 32 == 0 and cos.dtype == torch.bfloat16 and cos.shape[:2] == (B, T)  # not broadcast over B
        if fits and (ops := fused_ops(qkv)) is not None:  # one op where apply_rope takes five
            qk = ops.rope(qkv.view(B * T, -1), cos.reshape(B * T, D), sin.reshape(B * T, D), rotated)
            qk = qk.view(B, T, rotated, D)
        else:
            qk = apply_rope(qkv[:, :, :rotated], cos, sin)
        q, k, v = qk[:, :, : self.n_heads], qk[:, :, self.n_heads :], qkv[:, :, self.n_heads + self.n_kv :]
        if cache is None:
            out = dense_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, is_causal)
            out = out.transpose(1, 2)
        else:
            out = cache.attend(self.layer, q, k, v, mask, is_causal)  # [B, T, H, D]
        return self.o_proj(out.reshape(B, T, -1))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    is_causal: bool) -> torch.Tensor:
    """Attention over keys laid out contiguously per row (no cache, or a static one): one query per row by
    decode_attention, more by SDPA.  q [B, H, T, D]; k, v [B, Hkv, S, D]; mask [B, 1, T, S] or None -> [B, H, T, D]"""
    if q.shape[2] == 1:
        return decode_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one new query per row as two small matmuls; the G query heads sharing a KV head are
    stacked as G rows, so keys are never repeated and no fused-kernel launch cost is paid.
    q [B, H, 1, D]; k, v [B, Hkv, S, D]; mask [B, 1, 1, S] or None -> [B, H, 1, D]"""
    B, H, _, D = q.shape
    qg = q.reshape(B, k.shape[1], H // k.shape[1], D)  # [B, Hkv, G, D]
    if torch.compiler.is_compiling():  # plain reductions fuse into one loop; library bmm calls do not
        scores = (qg.unsqueeze(-2).float() * k.unsqueeze(2).float()).sum(-1) * D**-0.5  # [B, Hkv, G, S]
    else:
        scores = torch.matmul(qg, k.transpose(-1, -2)).float() * D**-0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1)
    if torch.compiler.is_compiling():
        out = (probs.unsqueeze(-1) * v.unsqueeze(2).float()).sum(-2).to(q.dtype)  # [B, Hkv, G, D]
    else:
        out = torch.matmul(probs.to(v.dtype), v)
    return out.reshape(B, H, 1, D)


class MLP(nn.Module):
    """SwiGLU feed-forward with one fused gate/up projection: down(silu(gate(x)) * up(x)), or down(h Q) with h that
    product when the model's config names an online rotation Q of down_proj's input (its weights then hold W Q)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.rotation = None if cfg.mlp_rotation is None else OnlineRotation(cfg.intermediate_size, cfg.mlp_rotation)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        I = gate_up.shape[-1] // 2
        if I % 16 == 0 and (ops := fused_ops(gate_up)) is not None:  # one op for the three below
            h = ops.silu_mul(gate_up.reshape(-1, 2 * I)).view(*gate_up.shape[:-1], I)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate) * up
        return self.down_proj(h if self.rotation is None else self.rotation(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache, mask, is_causal):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, mask, is_causal)
        return x + self.mlp(self.post_attention_layernorm(x))
