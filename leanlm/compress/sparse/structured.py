"""Structured pruning that shrinks the model: whole KV groups of attention heads, MLP neurons, or whole layers,
chosen on calibration data. The result is a smaller dense Transformer whose `config` matches its weights, so it
saves in the HF layout (models.config.hf_config_dict) and loads in `transformers`.

Each method removes the same number of units from every layer (HF configs are uniform). Its size is either an
explicit shape (heads=, intermediate_size=, num_layers=) or `target_params`, the fraction of ALL parameters
kept, embeddings and lm_head included (a model dominated by its embedding cannot reach small fractions by
pruning blocks; the error says what can be reached). The method's name picks the dimension that is cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn

from leanlm.compress.calibrate import DEFAULT_BATCH_SIZE, calibrate
from leanlm.compress.registry import register, renumber_layers
from leanlm.compress.sparse.slicing import (block_influence, kv_group_scores, merge_redundant, neuron_contribution,
                                            param_count, select_top, slice_attention, slice_mlp)
from leanlm.compress.stats import ChannelNorm, Hessian
from leanlm.errors import LeanLMError
from leanlm.models.config import ModelConfig
from leanlm.models.layers import Linear


def _check_size(method: str, target: float | None, shape_name: str, shape: int | None) -> None:
    if (target is None) == (shape is None):
        raise LeanLMError(f"{method}: give exactly one of --target-params F (fraction of parameters kept) "
                          f"or {shape_name}=N")
    if target is not None and not (isinstance(target, (int, float)) and 0 < target <= 1):
        raise LeanLMError(f"{method}: target_params is the fraction of parameters kept, in (0, 1]; got {target!r}")
    if shape is not None and not (isinstance(shape, int) and shape >= 1):
        raise LeanLMError(f"{method}: {shape_name} must be a positive whole number, got {shape!r}")


@dataclass(frozen=True)
class Heads:
    """Remove whole KV groups (a KV head with its query heads) with the least output energy on calibration data
    (slicing.kv_group_scores). heads: query heads kept per layer, a multiple of the GQA group size."""

    name: ClassVar[str] = "heads"
    kind: ClassVar[str] = "prune"
    needs_data: ClassVar[bool] = True
    target_params: float | None = None
    heads: int | None = None

    def __post_init__(self):
        _check_size(self.name, self.target_params, "heads", self.heads)


NEURON_CRITERIA = ("redundant", "activation", "contribution")


@dataclass(frozen=True)
class Neurons:
    """Remove MLP neurons, judged by their activations h = act(gate) * up over calibration tokens:
    redundant (default): a neuron nearly collinear with a kept one goes, folded into it, least output error
        first (slicing.merge_redundant; near-zero neurons cost nothing either). Of the three it left the lowest
        loss on SmolLM2-135M at 25% of parameters removed (eval loss 4.33 vs 4.46 activation, 4.53
        contribution; base 3.80), for an [I, I] Gram matrix per layer and about twice the time;
    activation: mean |h_j|, the lectures' criterion (neurons whose output is near zero go first);
    contribution: ||down[:, j]|| * ||h_j||, what removing j alone takes out of the MLP output."""

    name: ClassVar[str] = "neurons"
    kind: ClassVar[str] = "prune"
    needs_data: ClassVar[bool] = True
    target_params: float | None = None
    intermediate_size: int | None = None
    criterion: str = "redundant"

    def __post_init__(self):
        _check_size(self.name, self.target_params, "intermediate_size", self.intermediate_size)
        if self.criterion not in NEURON_CRITERIA:
            raise LeanLMError(f"neurons: unknown criterion {self.criterion!r}; "
                              f"choose one of {', '.join(NEURON_CRITERIA)}")


LAYER_CRITERIA = ("influence", "loss")


@dataclass(frozen=True)
class Layers:
    """Remove whole decoder layers: influence (default): those with the lowest block influence
    1 - cos(x_in, x_out) on calibration tokens, all at once (ShortGPT, https://arxiv.org/abs/2403.03853);
    loss: greedily, the layer whose removal raises the calibration loss least, one at a time (costs a model
    forward over the samples per remaining layer per removed layer)."""

    name: ClassVar[str] = "layers"
    kind: ClassVar[str] = "prune"
    needs_data: ClassVar[bool] = True
    target_params: float | None = None
    num_layers: int | None = None
    criterion: str = "influence"

    def __post_init__(self):
        _check_size(self.name, self.target_params, "num_layers", self.num_layers)
        if self.criterion not in LAYER_CRITERIA:
            raise LeanLMError(f"layers: unknown criterion {self.criterion!r}; "
                              f"choose one of {', '.join(LAYER_CRITERIA)}")


def units_kept(cfg: ModelConfig, target: float, shape: Callable[[int], ModelConfig], current: int, what: str) -> int:
    """How many of `current` units per layer to keep so that the parameter count is nearest to target * today's
    (shape(k) is the config with k units; the count is affine in k, so the nearest k is a rounding)."""
    base = param_count(shape(0))
    unit = (param_count(shape(current)) - base) / current
    kept = round((target * param_count(cfg) - base) / unit)
    if kept < 1:
        floor = param_count(shape(1)) / param_count(cfg)
        raise LeanLMError(f"target_params {target} cannot be reached by removing {what}: keeping one leaves "
                          f"{floor:.3f} of the parameters (embeddings included); ask for at least that")
    return min(kept, current)


def _shape_error(what: str, asked: int, have: int) -> LeanLMError:
    return LeanLMError(f"{what}={asked} is more than the {have} the model has; ask for 1 to {have}")


def _check_float(model: nn.Module, method: str) -> None:
    for i, b in enumerate(model.layers):
        for name, m in (("qkv_proj", b.self_attn.qkv_proj), ("o_proj", b.self_attn.o_proj),
                        ("gate_up_proj", b.mlp.gate_up_proj), ("down_proj", b.mlp.down_proj)):
            if not isinstance(m, Linear):
                raise LeanLMError(f"{method} cuts float projections, but layers.{i}.{name} is {type(m).__name__}: "
                                  "prune structurally before quantizing")


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class MeanAbs:
    """Mean |x_j| over all rows, the lectures' near-zero neuron criterion  # add_batch([..., K]); value [K]"""

    def __init__(self, K: int):
        self.sum, self.rows = torch.zeros(K, dtype=torch.float64), 0

    def add_batch(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1])
        self.sum += x.abs().sum(0, dtype=torch.float64).cpu()
        self.rows += x.shape[0]

    @property
    def value(self) -> torch.Tensor:
        return (self.sum / max(self.rows, 1)).float()


class _Unused:
    """Stats of a Linear the method does not look at."""

    def add_batch(self, x: torch.Tensor) -> None:
        pass


def _summary(before: ModelConfig, after: ModelConfig, **shape) -> dict:
    return {"params_before": param_count(before), "params_after": param_count(after),
            "fraction_kept": param_count(after) / param_count(before), **shape}


@register(Heads)
def prune_heads(model, config: Heads, progress=None, samples=None) -> dict[str, dict]:
    """Keep the same number of KV groups in every layer, per layer the ones of most output energy. Layers are
    calibrated in order on the outputs of the already pruned ones (compress.calibrate)."""
    _check_float(model, config.name)
    cfg = model.config
    G = cfg.num_heads // cfg.num_kv_heads
    if config.heads is not None:
        if config.heads > cfg.num_heads:
            raise _shape_error("heads", config.heads, cfg.num_heads)
        if config.heads % G:
            raise LeanLMError(f"heads={config.heads} is not a multiple of {G}: each KV head serves {G} query heads "
                              "and goes with them")
        keep = config.heads // G
    else:
        keep = units_kept(cfg, config.target_params, lambda k: replace(cfg, num_kv_heads=k, num_heads=k * G),
                          cfg.num_kv_heads, "KV heads")
    o_projs = {id(b.self_attn.o_proj) for b in model.layers}
    records = {}

    def solve(i: int, block: nn.Module, linears: dict) -> None:
        o_proj, xtx = linears[f"layers.{i}.self_attn.o_proj"]
        scores = kv_group_scores(o_proj.weight, xtx.value, cfg.num_kv_heads)
        kept = select_top(scores, keep)
        removed = sorted(set(range(cfg.num_kv_heads)) - set(kept.tolist()))
        before = _numel(block)
        slice_attention(block.self_attn, kept)
        records[f"layers.{i}.self_attn"] = {
            "kept_kv_heads": kept.tolist(), "removed_kv_heads": removed,
            "removed_heads": [h * G + g for h in removed for g in range(G)], "scores": scores.tolist(),
            "params_before": before, "params_after": _numel(block)}

    calibrate(model, samples, solve, lambda lin: Hessian(lin.in_features) if id(lin) in o_projs else _Unused(),
              progress=progress)
    model.config = replace(cfg, num_kv_heads=keep, num_heads=keep * G)
    return {"model": _summary(cfg, model.config, num_attention_heads=keep * G, num_key_value_heads=keep), **records}


# criterion -> (stats of down_proj's input h, select(stats value, down weight, keep) -> (kept, new down weight))
_NEURON_RULES = {
    "redundant": (Hessian, merge_redundant),
    "activation": (MeanAbs, lambda v, W, k: (select_top(v, k), None)),
    "contribution": (ChannelNorm, lambda v, W, k: (select_top(neuron_contribution(W, v), k), None)),
}


@register(Neurons)
def prune_neurons(model, config: Neurons, progress=None, samples=None) -> dict[str, dict]:
    """Keep the same number of MLP neurons in every layer, chosen per layer by the config's criterion on the
    activations that reach down_proj, calibrated layer by layer on the already pruned layers' outputs."""
    _check_float(model, config.name)
    cfg = model.config
    if cfg.mlp_rotation is not None:
        raise LeanLMError("neurons cannot be cut from an MLP whose down_proj input is rotated at run time (rotate "
                          "online: true): prune first, then rotate")
    if config.intermediate_size is not None:
        if config.intermediate_size > cfg.intermediate_size:
            raise _shape_error("intermediate_size", config.intermediate_size, cfg.intermediate_size)
        keep = config.intermediate_size
    else:
        keep = units_kept(cfg, config.target_params, lambda n: replace(cfg, intermediate_size=n),
                          cfg.intermediate_size, "MLP neurons")
    stats_cls, select = _NEURON_RULES[config.criterion]
    downs = {id(b.mlp.down_proj) for b in model.layers}
    records = {}

    def solve(i: int, block: nn.Module, linears: dict) -> None:
        down, stats = linears[f"layers.{i}.mlp.down_proj"]
        kept, down_weight = select(stats.value, down.weight, keep)
        before = _numel(block)
        slice_mlp(block.mlp, kept, down_weight)
        records[f"layers.{i}.mlp"] = {
            "removed_neurons": sorted(set(range(cfg.intermediate_size)) - set(kept.tolist())),
            "params_before": before, "params_after": _numel(block)}

    calibrate(model, samples, solve, lambda lin: stats_cls(lin.in_features) if id(lin) in downs else _Unused(),
              progress=progress)
    model.config = replace(cfg, intermediate_size=keep)
    return {"model": _summary(cfg, model.config, intermediate_size=keep, criterion=config.criterion), **records}


def drop_layers(model: nn.Module, kept: list[int]) -> None:
    """Keep only the decoder layers `kept` (ascending), renumbered 0.. for the KV cache; config updated."""
    model.layers = nn.ModuleList(model.layers[i] for i in kept)
    for i, block in enumerate(model.layers):
        block.self_attn.layer = i
    model.config = replace(model.config, num_layers=len(kept))


def _batches(samples: torch.Tensor, batch_size: int):
    for s in range(0, len(samples), batch_size):
        yield samples[s: s + batch_size]


@torch.no_grad()
def layer_influence(model: nn.Module, samples: torch.Tensor, batch_size: int = DEFAULT_BATCH_SIZE) -> torch.Tensor:
    """Block influence of every layer, averaged over all calibration tokens  # samples [n, T] -> [L]"""
    sums = torch.zeros(len(model.layers), dtype=torch.float64)

    def hook(i: int) -> Callable:
        return lambda module, args, out: sums.__setitem__(i, sums[i] + block_influence(args[0], out).double().sum())

    hooks = [b.register_forward_hook(hook(i)) for i, b in enumerate(model.layers)]
    try:
        positions = torch.arange(samples.shape[1], device=model.device)[None]
        for b in _batches(samples.to(model.device), batch_size):
            model.hidden(b, positions.expand(len(b), -1))
    finally:
        for h in hooks:
            h.remove()
    return (sums / samples.numel()).float()


@torch.no_grad()
def calibration_loss(model: nn.Module, samples: torch.Tensor, skip: set[int] = frozenset(),
                     batch_size: int = 4) -> float:
    """Mean next-token cross-entropy on `samples` [n, T] with the layers in `skip` left out (small batches: the
    logits [b, T, V] are the big tensor)."""
    T = samples.shape[1]
    cos, sin = model.rope(torch.arange(T, device=model.device)[None])
    total = 0.0
    for b in _batches(samples.to(model.device), batch_size):
        x = model.embed_tokens(b)
        for i, block in enumerate(model.layers):
            if i not in skip:
                x = block(x, cos, sin, None, None, T > 1)
        logits = model.logits(x[:, :-1]).float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten(), reduction="sum").item()
    return total / (len(samples) * (T - 1))


@register(Layers)
def prune_layers(model, config: Layers, progress=None, samples=None) -> dict[str, dict]:
    """Remove the same-shaped decoder layers that matter least on the calibration data (see Layers). The records
    name the smaller model's layers (each noting its number before, original_layer); the removed layers' are in
    the model's record (removed), and registry.merge_records renumbers earlier steps' records the same way."""
    cfg = model.config
    L = cfg.num_layers
    if config.num_layers is not None:
        if config.num_layers > L:
            raise _shape_error("num_layers", config.num_layers, L)
        keep = config.num_layers
    else:
        keep = units_kept(cfg, config.target_params, lambda n: replace(cfg, num_layers=n), L, "layers")
    records = {}
    if config.criterion == "influence":
        bi = layer_influence(model, samples)
        dropped = select_top(-bi, L - keep).tolist()  # the lowest influence
        for i in range(L):
            records[f"layers.{i}"] = {"block_influence": float(bi[i])}
            if progress is not None:
                progress(f"layers.{i}")
    else:
        dropped = []
        for step in range(L - keep):
            losses = {i: calibration_loss(model, samples, set(dropped) | {i}) for i in range(L) if i not in dropped}
            i = min(losses, key=losses.get)
            dropped.append(i)
            records[f"layers.{i}"] = {"step": step, "loss_after": losses[i]}
            if progress is not None:
                progress(f"layers.{i}")
        dropped.sort()
    # the removed layers' records go into the model's (by their number here); the kept ones' get their new numbers
    removed = [{"original_layer": i, **records.pop(f"layers.{i}"), "params_before": _numel(model.layers[i]),
                "params_after": 0} for i in dropped]
    kept = [i for i in range(L) if i not in dropped]
    drop_layers(model, kept)
    return {"model": _summary(cfg, model.config, num_hidden_layers=keep, removed_layers=dropped, kept_layers=kept,
                              criterion=config.criterion, removed=removed), **renumber_layers(records, kept)}
