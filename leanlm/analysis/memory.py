"""Textbook memory formulas for a decoder: parameters, KV cache, activations."""

from __future__ import annotations

from dataclasses import dataclass

from leanlm.models.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    embedding: int
    attention: int  # all layers, q/k/v/o (+ biases)
    mlp: int  # all layers, gate/up/down
    norms: int
    lm_head: int  # 0 when tied to the embedding

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.mlp + self.norms + self.lm_head

    @property
    def read_per_token(self) -> int:
        """Parameters a decode step reads in full: everything but the embedding table (one row is gathered)."""
        return self.total - self.embedding + (self.embedding if self.lm_head == 0 else 0)


def param_count(cfg: ModelConfig) -> ParamCount:
    d, L = cfg.hidden_size, cfg.num_layers
    qkv = d * (cfg.q_size + 2 * cfg.kv_size) + (cfg.q_size + 2 * cfg.kv_size if cfg.qkv_bias else 0)
    return ParamCount(
        embedding=cfg.vocab_size * d,
        attention=L * (qkv + cfg.q_size * d),
        mlp=L * 3 * d * cfg.intermediate_size,
        norms=(2 * L + 1) * d,
        lm_head=0 if cfg.tie_embeddings else cfg.vocab_size * d,
    )


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_value: float) -> float:
    """2 (K and V) x layers x kv_heads x head_dim x bytes."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * bytes_per_value


def kv_cache_bytes(cfg: ModelConfig, batch: int, length: int, bytes_per_value: float) -> float:
    return kv_bytes_per_token(cfg, bytes_per_value) * batch * length


def activation_bytes(cfg: ModelConfig, batch: int, tokens: int, bytes_per_value: float, logits_all: bool = False) -> float:
    """Peak transient memory of one forward over `tokens` new tokens (inference, layers run one at a time).

    Residual stream + normed copy (2d), fused q/k/v (q + 2kv) and attention output (q), fused gate/up (2I)
    and its product (I), the float32 copies RMSNorm makes (2d x 4 B), plus float32 logits for the last (or
    every) position.
    """
    per_token = 2 * cfg.hidden_size + max(2 * cfg.q_size + 2 * cfg.kv_size, 3 * cfg.intermediate_size)
    logits = batch * (tokens if logits_all else 1) * cfg.vocab_size * 4
    return batch * tokens * (per_token * bytes_per_value + 2 * cfg.hidden_size * 4) + logits


def stored_bytes(model) -> int:
    """Measured: bytes of every distinct parameter and buffer in memory (tied weights once, rope tables out)."""
    tensors = [p for p in model.parameters()] + [b for n, b in model.named_buffers() if not n.startswith("rope_")]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def weight_bytes_read(model) -> int:
    """Measured: bytes a decode step streams, i.e. all weights but an embedding table that is not also the
    lm_head (one row of it is read)."""
    return stored_bytes(model) - (0 if model.lm_head_is_embedding else model.embed_tokens.weight.nbytes)


def formula_weight_bytes(model) -> tuple[float, int]:
    """(bytes, parameters) by formula: each quantized projection at its bits per weight (scales included),
    every other parameter at its dtype's size."""
    total, params = 0.0, 0
    for m in model.modules():
        if hasattr(m, "BITS"):
            total += m.in_features * m.out_features * m.bits_per_weight / 8
            params += m.in_features * m.out_features
    for p in {id(p): p for p in model.parameters()}.values():
        total += p.numel() * p.element_size()
        params += p.numel()
    return total, params


def lm_head_kind(model) -> str:
    """How the output projection is stored, e.g. "int8 (w8a16)", "int4 g128 (w4a16)", "bfloat16, tied": what
    decode reads for every token's logits (V x d weights), so it matters for speed."""
    head = model.lm_head
    scheme = getattr(head, "SCHEME", None)
    if scheme is None:
        return str(head.weight.dtype).removeprefix("torch.") + (", tied" if model.lm_head_is_embedding else "")
    width = "int4" if head.BITS == 4 else "fp8" if scheme == "fp8" else "int8"
    group = f" g{head.group_size}" if hasattr(head, "group_size") else ""
    return f"{width}{group} ({scheme})"
