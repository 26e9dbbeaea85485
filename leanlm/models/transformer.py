"""Transformer: one readable decoder for the Llama family (Llama, SmolLM2, Mistral) and Qwen2."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from leanlm.models.config import ModelConfig
from leanlm.models.layers import Block, Linear, PackedEmbedding, RMSNorm, rope_table


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_table(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device  # a plain parameter in the model dtype even where the embedding is packed

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def lm_head_is_embedding(self) -> bool:
        """Tied and not quantized: the lm_head reads the embedding's own storage (packed or not)."""
        if isinstance(self.embed_tokens, PackedEmbedding):
            return getattr(self.lm_head, "packed", None) is self.embed_tokens.packed
        return getattr(self.lm_head, "weight", None) is self.embed_tokens.weight

    def untie_lm_head(self) -> None:
        """Give a tied lm_head its own copy of the embedding's weight, for a step that changes one and not the other
        (a fold of the final norm into the head); the config then says untied, so the model saves and loads so."""
        if self.lm_head_is_embedding:
            self.lm_head.weight = nn.Parameter(self.embed_tokens.weight.detach().clone())
            self.config = replace(self.config, tie_embeddings=False)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the rotary embedding at these positions, in the model dtype  # [B, T] -> [B, T, 1, D]"""
        return (self.rope_cos[positions].unsqueeze(2).to(self.dtype),
                self.rope_sin[positions].unsqueeze(2).to(self.dtype))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache=None, last_only: bool = False,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only, [B, R, V] at `rows` [R])."""
        x = self.hidden(tokens, positions, cache)
        if last_only:
            x = x[:, -1:]
        elif rows is not None:
            x = x[:, rows]
        return self.logits(x)

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache=None) -> torch.Tensor:
        """The last layer's output, before the final norm  # tokens, positions [B, T] -> [B, T, hidden]"""
        T = tokens.shape[1]
        x = self.embed_tokens(tokens)
        cos, sin = self.rope(positions)
        mask, is_causal = (None, T > 1) if cache is None else cache.attention_mask(T)
        for block in self.layers:
            x = block(x, cos, sin, cache, mask, is_causal)
        if cache is not None:
            cache.advance(T)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., V]"""
        return self.lm_head(self.norm(x))
