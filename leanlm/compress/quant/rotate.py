"""Rotate the residual stream (QuaRot, https://arxiv.org/abs/2404.00456): an orthogonal Q folded into the weights
so that the float model computes the same function while its activations and weights lose their outlier channels.

With every RMSNorm's weight folded into the projections that read it (the norm then only divides by rms, which Q
keeps), the residual stream x can live as x Q: the embedding becomes E Q, every projection reading the stream
(q/k/v, gate/up, lm_head) W Q, every one writing to it (o_proj, down_proj) Q^T W (and its bias b Q). An outlier
channel of x is spread over all channels of x Q, so per-token int8 activations (W8A8) and per-channel or group
weights lose less. Q is a Hadamard matrix with random signs, H diag(+-1) / sqrt(d), where one of order d is
known here (Sylvester 2^k times Paley's 1 + q for primes q = 3 mod 4: 576 = 72 x 8, 896 = 224 x 4), else a random
orthogonal matrix (QR of a Gaussian). The rotation is offline only (nothing changes at run time): the rotated model
is a plain Llama/Qwen2 model that exports and runs anywhere. A model whose lm_head shares the embedding's weights
gets its own lm_head (the final norm folds into it, not into the embedding): vocab x hidden more weights.
Each head's values are rotated too (QuaRot's offline head rotation): v_proj's rows of a KV head by H_D^T, o_proj's
columns of every query head reading it by H_D, so o_proj's input has no outlier channel within a head either.
With online: true, down_proj's input (the SwiGLU product, whose outliers no offline rotation reaches) is rotated at
run time as well (QuaRot's online Hadamard): down_proj's weights become W Q_I and the model's config names the seed
of Q_I, which the MLP applies (lowbit.hadamard.OnlineRotation). Such a model runs in leanlm only: export refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from leanlm.compress.registry import register
from leanlm.errors import LeanLMError
from leanlm.lowbit.hadamard import OnlineRotation, rotation
from leanlm.lowbit.linear import quantized_layers


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    param.data = value.to(param.dtype).contiguous()


@torch.no_grad()
def rotate_model(model: nn.Module, seed: int = 0, progress=None) -> torch.Tensor:
    """Fold the norms and rotate the residual stream of a float Transformer in place (see the module docstring);
    the products are computed in float64 and rounded once to the weights' dtype; progress(name) after each
    projection. Returns Q [d, d] float64."""
    if quantized_layers(model):
        raise LeanLMError("rotate works on float weights: put it before the quantization step in the recipe")
    d = model.config.hidden_size
    Q = rotation(d, seed)
    model.untie_lm_head()  # the final norm folds into the lm_head alone, so it needs its own weights

    def reads(linear: nn.Module, norm: nn.Module) -> None:  # W diag(g) Q
        _set(linear.weight, linear.weight.double() * norm.weight.double() @ Q)

    def writes(linear: nn.Module) -> None:  # Q^T W, b Q
        _set(linear.weight, Q.T @ linear.weight.double())
        if linear.bias is not None:
            _set(linear.bias, linear.bias.double() @ Q)

    _set(model.embed_tokens.weight, model.embed_tokens.weight.double() @ Q)
    D, heads, kv = model.config.head_dim, model.config.num_heads, model.config.num_kv_heads
    Qh = rotation(D, seed + 1)
    for i, block in enumerate(model.layers):
        rotate_values(block.self_attn.qkv_proj, block.self_attn.o_proj, Qh, heads, kv)
        reads(block.self_attn.qkv_proj, block.input_layernorm)
        reads(block.mlp.gate_up_proj, block.post_attention_layernorm)
        writes(block.self_attn.o_proj)
        writes(block.mlp.down_proj)
        for norm in (block.input_layernorm, block.post_attention_layernorm):
            norm.weight.fill_(1.0)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            if progress:
                progress(f"layers.{i}.{name}")
    reads(model.lm_head, model.norm)
    model.norm.weight.fill_(1.0)
    return Q


@torch.no_grad()
def rotate_mlp_inputs(model: nn.Module, seed: int) -> None:
    """down_proj's input h -> h Q_I at run time, its weights W -> W Q_I: (h Q_I)(W Q_I)^T = h W^T."""
    Q = rotation(model.config.intermediate_size, seed)
    for block in model.layers:
        _set(block.mlp.down_proj.weight, block.mlp.down_proj.weight.double() @ Q)
        block.mlp.rotation = OnlineRotation(model.config.intermediate_size, seed)
    model.config = replace(model.config, mlp_rotation=seed)


def rotate_values(qkv: nn.Module, o_proj: nn.Module, Qh: torch.Tensor, heads: int, kv: int) -> None:
    """Each KV head's values v_h -> v_h Qh (its rows of qkv: Qh^T W, bias b Qh) and o_proj's columns of each query
    head W -> W Qh: softmax(.) v_h Qh Qh^T W^T is what it was  # Qh [D, D]"""
    D = Qh.shape[0]
    w = qkv.weight.double()
    start = (heads + kv) * D  # the values' rows come after the queries' and keys'
    v = w[start:].reshape(kv, D, -1)
    _set(qkv.weight, torch.cat([w[:start], (Qh.T @ v).reshape(kv * D, -1)]))
    if qkv.bias is not None:
        b = qkv.bias.double()
        _set(qkv.bias, torch.cat([b[:start], (b[start:].reshape(kv, D) @ Qh).reshape(-1)]))
    o = o_proj.weight.double().reshape(-1, heads, D)
    _set(o_proj.weight, (o @ Qh).reshape(o_proj.weight.shape))


@dataclass(frozen=True)
class Rotate:
    """Rotate the residual stream (QuaRot's offline rotation, folded into the weights) for the quantization step
    after it, e.g. `- {method: rotate}` then `- {method: rtn, bits: 8, act_bits: 8}`."""

    name: ClassVar[str] = "rotate"
    kind: ClassVar[str] = "quantize"
    seed: int = 0  # the random signs (or the random orthogonal matrix)
    online: bool = False  # also rotate down_proj's input at run time (leanlm only; seed + 2)


@register(Rotate)
def rotate(model, config: Rotate, progress=None, samples=None) -> dict[str, dict]:
    if config.online and model.config.mlp_rotation is not None:
        raise LeanLMError("this model's down_proj input is rotated at run time already: give online: true once")
    rotate_model(model, config.seed, progress)
    if config.online:
        rotate_mlp_inputs(model, config.seed + 2)
    return {}  # the weights change, no layer's kind: the saved recipe names the step
