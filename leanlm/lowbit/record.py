"""How a quantized directory names its layers: quantization.json beside the safetensors, each quantized layer's
scheme and constructor options (written by compress.quant.format.save, read here when a model loads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from leanlm.errors import LeanLMError
from leanlm.lowbit.codebook import AdditiveLinear
from leanlm.lowbit.linear import SCHEMES as LINEAR_SCHEMES

RECORD = "quantization.json"
VERSION = 2  # of quantization.json and the tensors it describes; a reader refuses other versions
PRUNING_KEYS = ("sparsity", "pattern")  # what a pruned layer's record adds to its scheme's options
SCHEMES = {**LINEAR_SCHEMES, AdditiveLinear.SCHEME: AdditiveLinear}  # a record's scheme -> its module


def is_quantized(path: Path) -> bool:
    return (Path(path) / RECORD).exists()


def replace(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` in the place of the submodule called `name`."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


def restore_modules(model: nn.Module, path: Path) -> set[str]:
    """Swap in empty quantized modules as recorded (on the meta device); return their state-dict prefixes.
    A record is {"scheme": name, **options}: the options are the module's constructor keyword arguments."""
    record = json.loads((Path(path) / RECORD).read_text())
    if record.get("version", 1) != VERSION:
        raise LeanLMError(f"{path} holds quantization format {record.get('version', 1)}; this leanlm reads "
                          f"format {VERSION}: quantize the model again")
    layers = record["layers"]
    quantized = {name: rec for name, rec in layers.items() if "scheme" in rec}  # the rest were pruned in float
    for name, rec in quantized.items():
        linear = model.get_submodule(name)
        bias = None if linear.bias is None else torch.empty(linear.out_features, device="meta")
        options = {k: v for k, v in rec.items() if k not in ("scheme", *PRUNING_KEYS)}
        cls = SCHEMES.get(rec.get("scheme"))
        if cls is None:
            raise LeanLMError(f"{path}/{RECORD}: layer {name} has unknown scheme {rec.get('scheme')!r}; "
                              f"this leanlm reads {', '.join(SCHEMES)}")
        try:
            with torch.device("meta"):
                replace(model, name, cls(linear.in_features, linear.out_features, bias=bias, **options))
        except TypeError:
            raise LeanLMError(f"{path}/{RECORD}: layer {name} has options {options} that {rec['scheme']} "
                              "does not take; re-quantize with this leanlm") from None
    note_pruning(model, quantized)  # what pruning did before quantizing: the codes cannot say
    return {name + "." for name in quantized}


def note_pruning(model: nn.Module, records: dict[str, dict]) -> None:
    """Keep on each quantized projection what pruning did to it before (its record's sparsity and pattern, as
    `module.pruning`), which compress.sparse.masks.module_sparsity reads: its codes cannot say."""
    modules = dict(model.named_modules())
    for name, record in records.items():
        module = modules.get(name)
        if hasattr(module, "BITS") and "sparsity" in record:
            module.pruning = {k: record[k] for k in PRUNING_KEYS if k in record}
