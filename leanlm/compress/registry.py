"""Compression methods by name: a frozen config dataclass per method, registered with its handler."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict
from fnmatch import fnmatchcase

from torch import nn

from leanlm.errors import LeanLMError
from leanlm.models.layers import Linear

METHODS: dict[str, type] = {}  # CLI name -> config class
_HANDLERS: dict[type, Callable] = {}
KINDS = ("quantize", "prune", "distill")  # what a method does to a model: a config's `kind`


def register(config_cls: type) -> Callable:
    """@register(RTN) on `handler(model, config, progress, samples) -> {layer name: record}` makes 'rtn' a
    method. `samples` [n, T] are calibration token ids, None when the caller has none. The config class names
    itself (`name`) and says what it does (`kind`, one of KINDS). The methods are the modules that
    leanlm.pipeline imports, which also finds them by name."""
    if getattr(config_cls, "kind", None) not in KINDS:
        raise TypeError(f"{config_cls.__name__}.kind must be one of {KINDS}")

    def decorate(handler: Callable) -> Callable:
        METHODS[config_cls.name] = config_cls
        _HANDLERS[config_cls] = handler
        return handler

    return decorate


def recipe_steps(configs: list) -> list[dict]:
    """A recipe as saved with a model: each step {"method": name, **options}; a step saved before (a dict, e.g.
    from a pruned source's pruning.json) as it is."""
    return [c if isinstance(c, dict) else {"method": c.name, **asdict(c)} for c in configs]


def renumber_layers(records: dict[str, dict], kept: list[int]) -> dict[str, dict]:
    """Records named by decoder layer ("layers.I", "layers.I.mlp", ...) once only the layers `kept` (ascending)
    stay, renumbered 0..: each follows its layer to its new number, a layer's own record noting the number it had
    (original_layer, unless it has one from an earlier removal); those of removed layers are dropped."""
    new = {old: j for j, old in enumerate(kept)}
    out = {}
    for name, record in records.items():
        parts = name.split(".", 2)
        if parts[0] != "layers" or len(parts) < 2:
            out[name] = record
        elif int(parts[1]) in new:
            i = int(parts[1])
            out[".".join(["layers", str(new[i]), *parts[2:]])] = record if len(parts) > 2 else {"original_layer": i, **record}
    return out


def merge_records(records: dict[str, dict], step: dict[str, dict]) -> dict[str, dict]:
    """The records of earlier steps with one more step's merged in, layer by layer (a layer pruned, then quantized,
    keeps both). After a step that removed decoder layers (its "model" record lists kept_layers), the earlier
    records follow their layers to the saved model's numbers first (renumber_layers)."""
    kept = step.get("model", {}).get("kept_layers")
    merged = dict(records) if kept is None else renumber_layers(records, kept)
    for name, record in step.items():
        old = merged.get(name, {})
        merged[name] = {**old, **record, **{k: old[k] for k in ("original_layer",) if k in old}}  # the first number
    return merged


def apply(model: nn.Module, config, progress=None, samples=None) -> dict[str, dict]:
    """Run the method of `config` on the model in place; return what each layer became."""
    if getattr(config, "needs_data", False) and samples is None:
        raise LeanLMError(f"{config.name} needs calibration data (token ids [n, T]); none was given")
    return _HANDLERS[type(config)](model, config, progress, samples)


def decoder_linears(model: nn.Module) -> Iterator[tuple[str, Linear]]:
    """The projections inside the decoder blocks (embedding and lm_head stay as they are)."""
    for name, module in model.named_modules():
        if name.startswith("layers.") and isinstance(module, Linear):
            yield name, module



def layer_patterns(method: str, layers, values: str) -> dict:
    """A method's `layers` option checked to be {projection name or glob: value} (None: {}); a LeanLMError
    otherwise, saying the dict maps names to `values`."""
    if layers is not None and not (isinstance(layers, dict) and all(isinstance(p, str) for p in layers)):
        raise LeanLMError(f"{method} layers must map projection names (or globs) to {values}, got {layers!r}")
    return layers or {}


def last_match(layers: dict | None, name: str) -> str | None:
    """The last pattern of a method's `layers` (projection names or globs) that matches `name`; None if none does."""
    return next((p for p in reversed(list(layers or {})) if fnmatchcase(name, p)), None)


def check_patterns(method: str, layers: dict, names: list[str]) -> None:
    """A LeanLMError naming every pattern of `layers` that matches none of `names` (a typo would otherwise quietly
    give those projections the method's default)."""
    unmatched = [p for p in layers if not any(fnmatchcase(name, p) for name in names)]
    if unmatched:
        raise LeanLMError(f"{method} layers: {', '.join(map(repr, unmatched))} match no decoder projection left in "
                          f"float (names look like {names[0] if names else 'layers.0.mlp.down_proj'!r})")
