"""SmoothQuant: move activation outliers into the weights with an exact per-channel rescaling, then W8A8.

Paper: https://arxiv.org/abs/2211.10438 (Xiao et al., eq. 4: s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)).
Y = X W^T = (X diag(s)^-1) (W diag(s))^T; diag(s)^-1 folds into whatever produced X, so the float model
computes the same function while X / s has flatter channels for the per-token int8 activation grid.
Smoothed here: q/k/v (via input_layernorm), gate/up (via post_attention_layernorm), optionally down (via up's
rows); o_proj is not smoothed (on SmolLM2-135M its plain W8A8 costs ~0.1 perplexity of the 1.1 of all layers).
alpha: one value for every projection, or (the default) each projection's own, the candidate whose W8A8 product
has the least error on calibration rows: the best single value differs between models (0.7 on SmolLM2-135M,
0.5 on Qwen2.5-Coder-0.5B, where 0.7 kept only 8% of plain W8A8's perplexity gap away)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from leanlm.compress.calibrate import calibrate
from leanlm.compress.quant.rtn import quantize_decoder
from leanlm.compress.registry import register
from leanlm.compress.stats import AbsMax
from leanlm.errors import LeanLMError
from leanlm.lowbit.primitives import QuantSpec, fake_quantize

MIN_SCALE = 1e-5  # as the reference implementation: no zero or denormal scales from dead channels
ALPHAS = tuple(i / 10 for i in range(1, 10))  # 0.1, 0.2, ..., 0.9: the per-projection search's candidates
KEPT_ROWS = 1024  # calibration rows per projection that the search scores candidates on


def smoothing_scale(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max_i |W_ij|^(1 - alpha).  act_absmax [K], weight [N, K] -> s [K] float32"""
    a = act_absmax.float().clamp(min=MIN_SCALE)
    w = weight.detach().float().abs().amax(0).clamp(min=MIN_SCALE)  # [K]
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp(min=MIN_SCALE)


def fold(prev: torch.Tensor, nxt: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Divide the producer's output channels by s and multiply the consumer's input columns by s, in float32.
    prev [K] (a norm weight) or [K, D] (weight rows), nxt [N, K], s [K] -> (prev / s, nxt * s)"""
    return prev.float() / s.reshape(-1, *[1] * (prev.dim() - 1)), nxt.float() * s


def _fold_into(prev: torch.Tensor, nxt: torch.Tensor, s: torch.Tensor) -> None:
    """fold() in place, each result cast back to its tensor's dtype."""
    p, n = fold(prev, nxt, s)
    prev.copy_(p)
    nxt.copy_(n)


class SmoothStats(AbsMax):
    """AbsMax plus a random 1 / `keep_every` of the input rows (none when 0), the rows on which search_alpha scores
    each candidate smoothing. Random, not every k-th row: a stride that divides the window length would keep every
    window's first position, whose outsized activations would then count 16-32x their share here."""

    def __init__(self, K: int, keep_every: int = 0, device: torch.device | str | None = None):
        super().__init__(K, device)
        self.keep_every, self.kept = keep_every, []
        self._generator = torch.Generator().manual_seed(0)

    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate x [..., K]."""
        super().add_batch(x)
        if self.keep_every:
            rows = x.detach().reshape(-1, self.K)
            pick = torch.randperm(rows.shape[0], generator=self._generator)[: rows.shape[0] // self.keep_every]
            self.kept.append(rows[pick.to(rows.device)].float())


def search_alpha(x: torch.Tensor, absmax: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, float | None]:
    """The smoothing whose W8A8 product (per-token int8 x / s, per-channel int8 weight * s) is closest to the float
    x weight^T on the rows x, in squared error: s = smoothing_scale(absmax, weight, alpha) for alpha in ALPHAS, or
    no smoothing at all (s = 1, alpha None), so the choice is never worse than plain W8A8 on these rows.
    x [M, K] float32, absmax [K], weight [N, K] -> (s [K] float32, alpha)"""
    w = weight.detach().float()
    expected = x @ w.T

    def error(s: torch.Tensor) -> float:
        xq = fake_quantize(x / s, QuantSpec(8, granularity="token"))
        wq = fake_quantize(w * s, QuantSpec(8, granularity="channel"))
        return (xq @ wq.T - expected).square_().mean().item()

    best_s, best_alpha = torch.ones_like(absmax, dtype=torch.float32), None
    best_err = error(best_s)
    for alpha in ALPHAS:
        s = smoothing_scale(absmax, weight, alpha)
        err = error(s)
        if err < best_err:
            best_s, best_alpha, best_err = s, alpha, err
    return best_s, best_alpha


def block_scales(block: nn.Module, stats: dict[str, SmoothStats], alpha: float | None,
                 smooth_down: bool) -> dict[str, tuple[torch.Tensor, float | None]]:
    """{"self_attn.qkv_proj" | "mlp.gate_up_proj" | "mlp.down_proj" (if smooth_down): (s [K], alpha)} of one
    unmodified Block from its projections' input stats; alpha None searches each projection's own."""
    names = ["self_attn.qkv_proj", "mlp.gate_up_proj"] + (["mlp.down_proj"] if smooth_down else [])
    scales = {}
    for name in names:
        weight, st = block.get_submodule(name).weight, stats[name]
        if alpha is None:
            scales[name] = search_alpha(torch.cat(st.kept), st.value, weight)
        else:
            scales[name] = smoothing_scale(st.value, weight, alpha), alpha
    return scales


@torch.no_grad()
def smooth_block(block: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Fold the scales of block_scales into one Block in place: 1 / s into input_layernorm (qkv),
    post_attention_layernorm (gate_up) and the up rows of gate_up (down, whose input is silu(gate) * up)."""
    attn, mlp = block.self_attn, block.mlp
    _fold_into(block.input_layernorm.weight, attn.qkv_proj.weight, scales["self_attn.qkv_proj"])
    _fold_into(block.post_attention_layernorm.weight, mlp.gate_up_proj.weight, scales["mlp.gate_up_proj"])
    if "mlp.down_proj" in scales:
        up = mlp.gate_up_proj.weight[mlp.down_proj.in_features:]  # [I, d], a view
        _fold_into(up, mlp.down_proj.weight, scales["mlp.down_proj"])


def smooth(model: nn.Module, samples: torch.Tensor, alpha: float | None = None, smooth_down: bool = True,
           progress=None) -> dict[str, float | None]:
    """Smooth every block of a float model in place (an exact rewrite up to the weights' rounding); return
    {projection name: its alpha} (None: left unsmoothed by the search).
    As in the paper, every scale comes from the activations of the unmodified model on `samples` [n, T]:
    the folds wait until calibration has seen all blocks, so no block is calibrated on smoothed (re-rounded)
    predecessors. A searched alpha is scored on about KEPT_ROWS of each projection's calibration rows."""
    scales = {}  # block index -> {projection: (s [K], alpha)}, a few KB per block
    smooth_down = smooth_down and model.config.mlp_rotation is None  # a rotated input: up's rows cannot take s
    keep_every = max(1, samples.numel() // KEPT_ROWS) if alpha is None else 0

    def solve(index, block, linears):
        prefix = f"layers.{index}."
        scales[index] = block_scales(block, {n.removeprefix(prefix): st for n, (_, st) in linears.items()},
                                     alpha, smooth_down)
        if progress:
            for name in linears:
                progress(name)

    calibrate(model, samples, solve, lambda linear: SmoothStats(linear.in_features, keep_every))
    for index, block in enumerate(model.layers):
        smooth_block(block, {name: s for name, (s, _) in scales[index].items()})
    return {f"layers.{i}.{name}": a for i, block in scales.items() for name, (_, a) in block.items()}


@torch.no_grad()
def smooth_head(model: nn.Module, samples: torch.Tensor, batch_size: int = 8) -> float | None:
    """Smooth the lm_head's input as block_scales smooths a block's (search_alpha on about KEPT_ROWS of its rows on
    `samples` [n, T], through the model as it is now), folding 1 / s into the final norm, whose output only the head
    reads; a head tied to the embedding gets its own copy of the weight first (the embedding keeps its rows).
    Returns the alpha (None: left unsmoothed)."""
    stats = SmoothStats(model.lm_head.in_features, max(1, samples.numel() // KEPT_ROWS))
    positions = torch.arange(samples.shape[1], device=model.device)[None]
    for i in range(0, samples.shape[0], batch_size):
        tokens = samples[i : i + batch_size].to(model.device)
        stats.add_batch(model.norm(model.hidden(tokens, positions.expand(len(tokens), -1))).float())
    model.untie_lm_head()
    s, alpha = search_alpha(torch.cat(stats.kept), stats.value, model.lm_head.weight)
    _fold_into(model.norm.weight, model.lm_head.weight, s)
    return alpha


@dataclass(frozen=True)
class SmoothQuant:
    """Smooth with migration strength alpha (each projection's own by default; down_proj through up's rows), then
    W8A8 with per-channel int8 weights and per-token dynamic int8 activations. Perplexity (KL to bf16):
    - SmolLM2-135M, 64 x 512 calibration windows, 16384 evaluation tokens: bf16 27.273, plain W8A8 28.116
      (0.0273), searched alpha 27.502 (0.0094); a fixed 0.7 gave 27.576 (at 4d9a571).
    - SmolLM2-135M, 32 x 512, 2048 / 8192 tokens, fixed alpha: bf16 28.62 / 29.08, plain W8A8 29.73 / 30.13;
      alpha 0.5 / 0.6 / 0.7 / 0.8 with smooth_down 29.02 / 29.06 / 28.73 / 29.04 (8192: 29.59 / 29.31 / 29.19 /
      29.51), without 29.58 / 29.27 / 29.19 / 29.15 (8192 at 0.7: 29.61).
    - Qwen2.5-Coder-0.5B, 32 x 512, 8192 tokens: bf16 55.253, plain W8A8 55.901 (0.0110), alpha 0.7 55.851
      (0.0075), 0.5 55.113 (0.0071), searched 55.326 (0.0071; quantizing took 495 s beside another job),
      searched on every 16th row (every window's first position among them) in 0.05 steps 55.711 (0.0071)."""

    name: ClassVar[str] = "smoothquant"
    kind: ClassVar[str] = "quantize"
    needs_data: ClassVar[bool] = True
    alpha: float | None = None  # None: searched per projection (search_alpha)
    smooth_down: bool = True

    def __post_init__(self):
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise LeanLMError(f"smoothquant alpha={self.alpha!r} is out of range; use a value in [0, 1] such as 0.5")


@register(SmoothQuant)
def smoothquant(model, config: SmoothQuant, progress=None, samples=None) -> dict[str, dict]:
    smooth(model, samples, config.alpha, config.smooth_down, progress)
    return quantize_decoder(model, "w8a8")


@dataclass(frozen=True)
class Smooth(SmoothQuant):
    """The smoothing alone (the float model computes the same function), for recipes that quantize next."""

    name: ClassVar[str] = "smooth"


@register(Smooth)
def smooth_only(model, config: Smooth, progress=None, samples=None) -> dict[str, dict]:
    smooth(model, samples, config.alpha, config.smooth_down, progress)
    return {}
