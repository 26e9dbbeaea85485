"""Compression methods by name: a frozen config dataclass per method, registered with its handler."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn

from leanlm.errors import LeanLMError
from leanlm.models.layers import Linear

METHODS: dict[str, type] = {}  # CLI name -> config class
_HANDLERS: dict[type, Callable] = {}


def register(config_cls: type) -> Callable:
    """@register(RTN) on `handler(model, config, progress, samples) -> {layer name: record}` makes 'rtn' a
    method. `samples` [n, T] are calibration token ids, None when the caller has none."""

    def decorate(handler: Callable) -> Callable:
        METHODS[config_cls.name] = config_cls
        _HANDLERS[config_cls] = handler
        return handler

    return decorate


def method(name: str) -> type:
    try:
        return METHODS[name]
    except KeyError:
        raise LeanLMError(f"unknown method {name!r}; choose one of: {', '.join(sorted(METHODS))}") from None


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
