"""What the sequence- and feature-level losses need besides logits: TinyBERT's hidden states and attention maps
(arXiv 1909.10351), captured by hooks during an ordinary forward, and MiniLLM's teacher-mixed samples (arXiv
2306.08543)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from leanlm.generation.decode import decode_step, prefill
from leanlm.models.layers import apply_rope


@dataclass
class Features:
    """One forward's embedding output [B, T, d], and per captured layer its output [B, T, d] and its attention
    scores q·k/√D before the softmax [B, H, T, T] (0 above the diagonal: causal)."""

    embedding: torch.Tensor | None = None
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    scores: dict[int, torch.Tensor] = field(default_factory=dict)


def _scores(attn, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The causal score maps of one attention layer from its fused q/k/v projection's output  # -> [B, H, T, T]"""
    B, T, _ = qkv.shape
    qk = apply_rope(qkv.view(B, T, -1, attn.head_dim)[:, :, : attn.n_heads + attn.n_kv], cos, sin)
    q = qk[:, :, : attn.n_heads].transpose(1, 2).float()  # [B, H, T, D]
    k = qk[:, :, attn.n_heads :].transpose(1, 2).float().repeat_interleave(attn.n_heads // attn.n_kv, dim=1)
    scores = q @ k.transpose(-1, -2) * attn.head_dim**-0.5
    return scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), 0.0)


@contextmanager
def captured(model, layers: list[int]):
    """Hooks that fill a Features with `layers`' outputs and score maps during forwards inside the block (a
    plain forward without a cache: the maps cover the window)."""
    found, hooks, rope = Features(), [], {}
    hooks.append(model.embed_tokens.register_forward_hook(lambda m, args, out: setattr(found, "embedding", out)))
    for i in layers:
        block, attn = model.layers[i], model.layers[i].self_attn
        hooks.append(block.register_forward_hook(lambda m, args, out, i=i: found.hidden.__setitem__(i, out)))
        hooks.append(attn.register_forward_pre_hook(lambda m, args, i=i: rope.__setitem__(i, args[1:3])))
        hooks.append(attn.qkv_proj.register_forward_hook(
            lambda m, args, out, i=i, attn=attn: found.scores.__setitem__(i, _scores(attn, out, *rope[i]))))
    try:
        yield found
    finally:
        for hook in hooks:
            hook.remove()


def uniform_layer_map(student_layers: int, teacher_layers: int) -> tuple[int, ...]:
    """TinyBERT's g(m) = m · N / M (1-based): student layer m learns from teacher layer g(m), the last from the last."""
    return tuple(round((m + 1) * teacher_layers / student_layers) - 1 for m in range(student_layers))


@torch.no_grad()
def mixed_samples(student, teacher, prefix: torch.Tensor, new: int, alpha: float,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniLLM's teacher-mixed sampling: each next token from p̃ = α p + (1 − α) q (p the teacher's distribution,
    q the student's), which keeps the student's rollouts from drifting where the teacher gives no signal.
    prefix [B, h] -> (tokens [B, new], log p̃ of each [B, new])"""
    rows = prefix.tolist()
    logits_s, cache_s = prefill(student, rows, new)
    logits_t, cache_t = prefill(teacher, rows, new)
    tokens, logp = [], []
    for step in range(new):
        mix = alpha * logits_t.float().softmax(-1) + (1 - alpha) * logits_s.float().softmax(-1)  # [B, V]
        y = torch.multinomial(mix.cpu(), 1, generator=generator)[:, 0].to(mix.device)
        tokens.append(y)
        logp.append(mix.gather(-1, y[:, None])[:, 0].log())
        if step + 1 < new:
            logits_s, logits_t = decode_step(student, cache_s, y), decode_step(teacher, cache_t, y)
    return torch.stack(tokens, 1), torch.stack(logp, 1)
