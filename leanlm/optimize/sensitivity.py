"""Per-layer sensitivity and mixed precision: the KL each decoder projection causes when it alone is quantized (or
pruned), a chart of it, and a knapsack that gives each projection its precision under a byte budget.

The knapsack assumes the damage adds up: the KL of a model with several projections quantized is taken to be the sum
of the KLs each causes alone (HAWQ-V3's and AutoRound's AutoScheme's assumption; https://arxiv.org/abs/2011.10680).
It holds while each error is small; benchmarks/mixed_precision.py measures the assembled model to check it.
llama.cpp's Q4_K_M is the hand-written version of the same idea (attn_v and ffn_down get more bits)."""

from __future__ import annotations

import copy
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from leanlm.analysis.memory import stored_bytes
from leanlm.compress.quant.rtn import KEEP_FLOAT, RTN, quantize_layer
from leanlm.compress.registry import decoder_linears, recipe_steps
from leanlm.compress.sparse.magnitude import magnitude_prune
from leanlm.errors import LeanLMError
from leanlm.lowbit.record import replace

FLOAT = "float"  # the option of leaving a projection as it is: KL 0 at its float bytes


@dataclass(frozen=True)
class Quantize:
    """Round-to-nearest of one projection onto a runtime kernel: 8 bits per channel (W8A16) or 4 in groups (W4A16);
    a projection whose K the group does not divide gets the largest that does, as rtn gives it (rtn.group_for)."""

    bits: int = 4
    group_size: int = 128

    @property
    def name(self) -> str:
        return "w8" if self.bits == 8 else f"w4g{self.group_size}"

    def module(self, linear: nn.Module) -> nn.Module:
        if self.bits == 8:
            return quantize_layer(linear, "w8a16")[0]
        return quantize_layer(linear, "w4a16", self.group_size)[0]


@dataclass(frozen=True)
class Prune:
    """Magnitude pruning of one projection, per output row; stored dense in float, so it saves no bytes: for the
    sensitivity chart (which layers tolerate pruning), not for the knapsack."""

    sparsity: float = 0.5

    @property
    def name(self) -> str:
        return f"prune{round(self.sparsity * 100)}"

    def module(self, linear: nn.Module) -> nn.Module:
        new = copy.deepcopy(linear)
        new.weight.data = magnitude_prune(linear.weight.data, self.sparsity)
        return new


DEFAULT_OPTIONS = (Quantize(4, 128), Quantize(8))


def parse_option(name: str) -> Quantize | Prune | None:
    """'w8', 'w4g32|64|128', 'prune50' -> the option; 'float' -> None (the projection left as it is)."""
    if name == FLOAT:
        return None
    if name == "w8":
        return Quantize(8)
    if m := re.fullmatch(r"w4g(32|64|128)", name):
        return Quantize(4, int(m[1]))
    if (m := re.fullmatch(r"prune(\d{1,2})", name)) and 0 < int(m[1]):
        return Prune(int(m[1]) / 100)
    raise LeanLMError(f"unknown sensitivity option {name!r}; use w8, w4g32, w4g64, w4g128, pruneNN (e.g. prune50) "
                      f"or {FLOAT}")


@dataclass
class UnitSensitivity:
    """One decoder projection: its KL and top-1 agreement with the float model, and its stored bytes, per option."""

    name: str  # e.g. layers.3.mlp.down_proj
    layer: int
    params: int  # weights (in_features x out_features)
    float_bytes: int
    kl: dict[str, float] = field(default_factory=dict)  # option -> mean KL(float || this alone changed), nats/token
    top1: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)  # option -> stored bytes of the module (scales included)

    @property
    def kind(self) -> str:
        """The projection's name inside its layer, e.g. mlp.down_proj."""
        return self.name.split(".", 2)[2]

    def cost(self, option: str) -> tuple[float, int]:
        """(KL, bytes) of an option; (inf, float bytes) where the option could not be applied to this projection."""
        if option == FLOAT:
            return 0.0, self.float_bytes
        kl = self.kl.get(option)
        return (math.inf, self.float_bytes) if kl is None else (kl, self.bytes[option])


@dataclass
class Sensitivity:
    options: list[str]
    tokens: int  # positions each KL is averaged over
    units: list[UnitSensitivity]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Sensitivity":
        return cls(list(d["options"]), int(d["tokens"]), [UnitSensitivity(**u) for u in d["units"]])

    def unit(self, name: str) -> UnitSensitivity:
        return next(u for u in self.units if u.name == name)

    @property
    def params(self) -> int:
        return sum(u.params for u in self.units)


def _windows(ids: torch.Tensor, window: int) -> torch.Tensor:
    """Disjoint windows of `window` tokens as one batch (a tail that fills none is dropped)  # [N] -> [B, window]"""
    if ids.dim() != 1 or len(ids) < 2:
        raise LeanLMError(f"sensitivity needs a token stream of at least 2 tokens, got shape {tuple(ids.shape)}")
    window = min(window, len(ids))
    return ids[:len(ids) // window * window].view(-1, window)


class _Suffix:
    """The float model's layer inputs and output distribution on a batch of windows, so that a change to layer i is
    measured by running layers i.. only: the inputs to the layers before it do not change."""

    def __init__(self, model, windows: torch.Tensor):  # [B, T]
        self.model = model
        B, T = windows.shape
        self.cos, self.sin = model.rope(torch.arange(T, device=model.device)[None])
        x = model.embed_tokens(windows.to(model.device))
        self.inputs = []  # [B, T, hidden] entering each layer
        for block in model.layers:
            self.inputs.append(x)
            x = block(x, self.cos, self.sin, None, None, T > 1)
        self.logp = model.logits(x).float().log_softmax(-1)  # [B, T, V]
        self.top = self.logp.argmax(-1)  # [B, T]

    def compare(self, layer: int) -> tuple[float, float, int]:
        """(mean KL(float || model), top-1 agreement, positions) with the model as it is now, changed at `layer`
        and after it only."""
        x = self.inputs[layer]
        for block in self.model.layers[layer:]:
            x = block(x, self.cos, self.sin, None, None, x.shape[1] > 1)
        logq = self.model.logits(x).float().log_softmax(-1)
        # summed term by term, not as sum p log p - sum p log q: two large sums would cancel to float32 noise
        kl = F.kl_div(logq, self.logp, reduction="sum", log_target=True).item()
        same = (logq.argmax(-1) == self.top).sum().item()
        return max(kl, 0.0) / self.top.numel(), same / self.top.numel(), self.top.numel()


@torch.inference_mode()
def layer_sensitivity(model, ids: torch.Tensor, options: Sequence = DEFAULT_OPTIONS, window: int = 512,
                      units: Sequence[str] | None = None,
                      progress: Callable[[str, str], None] | None = None) -> Sensitivity:
    """For each decoder projection (`units`: names, default all) and each option (Quantize, Prune), change that
    projection alone, measure KL(float || model) and top-1 agreement on ids [N] in disjoint windows of `window`
    tokens (run as one batch), and put the float projection back (the same module object: the model is restored
    exactly). Bytes are those of the real module stored (int4 group scales and zeros included).
    Give it a float32 model: in bf16, any change to one projection moves the output by ~1e-3 nats of KL (bf16
    rounding of everything downstream), as much as an int8 projection's own error on SmolLM2-135M."""
    linears = dict(decoder_linears(model))
    names = list(linears) if units is None else list(units)
    if missing := [n for n in names if n not in linears]:
        raise LeanLMError(f"no float decoder projection {missing[0]!r} in the model (names look like "
                          f"{next(iter(linears), 'layers.0.mlp.down_proj')!r})")
    if len({o.name for o in options}) != len(options):
        raise LeanLMError(f"sensitivity options repeat a name: {[o.name for o in options]}")
    window = min(window, model.config.max_position)
    ref = _Suffix(model, _windows(ids, window))
    result = Sensitivity([o.name for o in options], 0, [])
    for name in names:
        linear = linears[name]
        unit = UnitSensitivity(name, int(name.split(".")[1]), linear.in_features * linear.out_features,
                               stored_bytes(linear))
        for option in options:
            try:
                new = option.module(linear)
            except LeanLMError:  # e.g. no int4 group size divides this projection's K: the knapsack skips it
                continue
            replace(model, name, new)
            try:
                unit.kl[option.name], unit.top1[option.name], result.tokens = ref.compare(unit.layer)
            finally:
                replace(model, name, linear)
            unit.bytes[option.name] = stored_bytes(new)
            if progress:
                progress(name, option.name)
        result.units.append(unit)
    return result


def assign_bits(costs: Sequence[Sequence[float]], sizes: Sequence[Sequence[int]], budget: float,
                max_cells: int = 100_000) -> list[int]:
    """Multiple-choice knapsack: one option per unit (costs[u][k], sizes[u][k] bytes) minimising the summed cost with
    the summed size <= budget; returns the chosen option of each unit. Exact dynamic programming over the bytes
    above each unit's smallest option, counted in cells of r bytes, r = 1 unless that would take more than
    `max_cells` cells: sizes are then rounded up to whole cells, so the result always fits the budget and is optimal
    for the rounded sizes (within units x r bytes of the budget). O(units x options x cells)."""
    if len(costs) != len(sizes) or any(len(c) != len(s) or not c for c, s in zip(costs, sizes)):
        raise LeanLMError("assign_bits needs costs and sizes of the same shape, at least one option per unit")
    low = [min(s) for s in sizes]
    room = budget - sum(low)
    if room < 0:
        raise LeanLMError(f"a budget of {budget:,.0f} bytes is below the smallest assignment ({sum(low):,} bytes)")
    r = max(1, math.ceil(room / max_cells))
    cells = int(room // r)
    best = np.zeros(cells + 1)  # best[c]: least cost of the units so far within c cells of extra bytes
    choices = []
    for cost, size, lo in zip(costs, sizes, low):
        new = np.full(cells + 1, np.inf)
        pick = np.zeros(cells + 1, dtype=np.int16)
        for k, (c, s) in enumerate(zip(cost, size)):
            w = math.ceil((s - lo) / r)
            if w > cells:
                continue
            cand = np.full(cells + 1, np.inf)
            cand[w:] = best[:cells + 1 - w] + c
            better = cand < new
            new[better], pick[better] = cand[better], k
        best = new
        choices.append(pick)
    if not math.isfinite(best[cells]):
        raise LeanLMError("no assignment within the budget has a finite cost (an option could not be measured)")
    chosen, c = [], cells
    for cost, size, lo, pick in zip(reversed(costs), reversed(sizes), reversed(low), reversed(choices)):
        k = int(pick[c])
        chosen.append(k)
        c -= math.ceil((size[k] - lo) / r)
    return chosen[::-1]


def mixed_assignment(result: Sensitivity, options: Sequence[str], budget_bytes: float | None = None,
                     avg_bits: float | None = None) -> dict[str, str]:
    """{projection: option} of least summed KL whose stored bytes stay within budget_bytes, or within avg_bits per
    weight over the measured projections (scales included); `options` are names measured in `result`, or 'float'."""
    if (budget_bytes is None) == (avg_bits is None):
        raise LeanLMError("give the budget as exactly one of budget_bytes or avg_bits")
    if unknown := [o for o in options if o != FLOAT and o not in result.options]:
        raise LeanLMError(f"option {unknown[0]!r} was not measured; the result has {', '.join(result.options)}")
    budget = budget_bytes if budget_bytes is not None else avg_bits * result.params / 8
    pairs = [[u.cost(o) for o in options] for u in result.units]
    chosen = assign_bits([[c for c, _ in p] for p in pairs], [[s for _, s in p] for p in pairs], budget)
    return {u.name: options[k] for u, k in zip(result.units, chosen)}


def assignment_bytes(result: Sensitivity, assignment: dict[str, str]) -> int:
    return sum(result.unit(n).cost(o)[1] for n, o in assignment.items())


def predicted_kl(result: Sensitivity, assignment: dict[str, str]) -> float:
    """The knapsack's objective: the per-projection KLs summed (the additivity assumption)."""
    return sum(result.unit(n).cost(o)[0] for n, o in assignment.items())


def mixed_config(assignment: dict[str, str], act_bits: int = 16) -> RTN:
    """The RTN config that applies an assignment {projection: 'w8' | 'w4gG' | 'float'}: the commonest option as its
    default, the others as per-projection `layers` overrides."""
    parsed = {name: parse_option(o) for name, o in assignment.items()}
    if pruned := [n for n, o in parsed.items() if isinstance(o, Prune)]:
        raise LeanLMError(f"{pruned[0]} is assigned {assignment[pruned[0]]}: rtn applies w8, w4gG or float only")
    counts = Counter(o for o in parsed.values() if o is not None)
    default = counts.most_common(1)[0][0] if counts else Quantize(8)
    layers = {}
    for name, o in parsed.items():
        if o is None:
            layers[name] = KEEP_FLOAT
        elif o != default:
            layers[name] = o.bits if o.bits == 8 or o.group_size == default.group_size else \
                {"bits": 4, "group_size": o.group_size}
    return RTN(default.bits, default.group_size, act_bits=act_bits, layers=layers or None)


def mixed_recipe(assignment: dict[str, str], act_bits: int = 16) -> str:
    """The assignment as a `leanlm quantize --recipe` file (YAML: one rtn step with per-projection `layers`)."""
    return yaml.safe_dump(recipe_steps([mixed_config(assignment, act_bits)]), sort_keys=False)


def sensitivity_chart(result: Sensitivity, path: str | Path, title: str = "") -> None:
    """A PNG: one panel per projection kind (qkv, o, gate_up, down), a bar per layer and option, KL on a log axis."""
    import matplotlib  # heavy: only the chart needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(dict.fromkeys(u.kind for u in result.units))
    layers = sorted({u.layer for u in result.units})
    width = 0.8 / max(len(result.options), 1)
    wide = min(18, max(8, 4 + 0.12 * len(layers) * len(result.options)))  # inches; bars get thin past 18
    fig, axes = plt.subplots(len(kinds), 1, figsize=(wide, 2.3 * len(kinds)), sharex=True, squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds):
        for j, option in enumerate(result.options):
            points = [(u.layer, u.kl[option]) for u in result.units if u.kind == kind and u.kl.get(option, 0) > 0]
            if points:
                xs, ys = zip(*points)
                ax.bar([x + (j - (len(result.options) - 1) / 2) * width for x in xs], ys, width, label=option)
        ax.set_yscale("log")
        ax.set_ylabel(f"{kind}\nKL (nats)")
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(ncol=len(result.options), fontsize=8)
    axes[-1, 0].set_xlabel("decoder layer")
    axes[-1, 0].set_xticks(layers)
    fig.suptitle(title or f"KL when one projection alone is changed ({result.tokens} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
