"""Compression methods by name: a frozen config dataclass per method, registered with its handler."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, fields
from pathlib import Path

from torch import nn

from leanlm.errors import LeanLMError
from leanlm.models.layers import Linear

METHODS: dict[str, type] = {}  # CLI name -> config class
_HANDLERS: dict[type, Callable] = {}
# Each module registers its methods when imported; `method()` imports them all on first use.
MODULES = ("leanlm.compress.quant.rtn", "leanlm.compress.quant.gptq", "leanlm.compress.quant.awq",
           "leanlm.compress.quant.smoothquant", "leanlm.compress.quant.llm_int8",
           "leanlm.compress.sparse.structured", "leanlm.compress.sparse.magnitude", "leanlm.compress.sparse.wanda",
           "leanlm.compress.sparse.sparsegpt", "leanlm.compress.sparse.taylor")


def register(config_cls: type) -> Callable:
    """@register(RTN) on `handler(model, config, progress, samples) -> {layer name: record}` makes 'rtn' a
    method. `samples` [n, T] are calibration token ids, None when the caller has none."""

    def decorate(handler: Callable) -> Callable:
        METHODS[config_cls.name] = config_cls
        _HANDLERS[config_cls] = handler
        return handler

    return decorate


def method(name: str) -> type:
    for module in MODULES:
        importlib.import_module(module)
    try:
        return METHODS[name]
    except KeyError:
        raise LeanLMError(f"unknown method {name!r}; choose one of: {', '.join(sorted(METHODS))}") from None


def make_config(name: str, options: dict):
    """The config of method `name` from option values; a clear error for an option it does not take."""
    cls = method(name)
    known = [f.name for f in fields(cls)]
    unknown = [k for k in options if k not in known]
    if unknown:
        takes = f"its options: {', '.join(known)}" if known else "it takes no options"
        raise LeanLMError(f"{name} has no option {', '.join(unknown)} ({takes})")
    return cls(**options)


def read_recipe(path: Path) -> list:
    """Configs from a YAML list of steps, each {method: NAME, option: value, ...}, applied in order. A method
    quantizes the projections that earlier steps left in float, so `smooth` then `rtn` is SmoothQuant."""
    import yaml

    try:
        steps = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise LeanLMError(f"cannot read recipe {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise LeanLMError(f"recipe {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(steps, list) or not steps or not all(isinstance(s, dict) and "method" in s for s in steps):
        raise LeanLMError(f"recipe {path} must be a non-empty YAML list of steps such as `- method: rtn`")
    return [make_config(step["method"], {k: v for k, v in step.items() if k != "method"}) for step in steps]


def recipe_steps(configs: list) -> list[dict]:
    """A recipe as saved with a model: each step {"method": name, **options}; a step saved before (a dict, e.g.
    from a pruned source's pruning.json) as it is."""
    return [c if isinstance(c, dict) else {"method": c.name, **asdict(c)} for c in configs]


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


def replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)
