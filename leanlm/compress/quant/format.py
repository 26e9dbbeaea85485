"""A quantized model on disk: our state dict in safetensors plus quantization.json naming each layer's scheme."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from leanlm.compress.quant.linear import SCHEMES
from leanlm.compress.registry import recipe_steps, replace
from leanlm.compress.sparse.masks import PRUNING_KEYS, note_pruning
from leanlm.errors import LeanLMError
from leanlm.models.config import write_hf_config

RECORD = "quantization.json"
VERSION = 2  # of quantization.json and the tensors it describes; a reader refuses other versions
COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def is_quantized(path: Path) -> bool:
    return (Path(path) / RECORD).exists()


def copy_model_files(source: Path, out: Path) -> None:
    """The source model's config and tokenizer files (those of COPIED it has) into `out`."""
    for name in COPIED:
        if (Path(source) / name).exists():
            shutil.copy(Path(source) / name, out / name)


def save(model, records: dict[str, dict], configs, source: Path, out: Path) -> None:
    """Write weights, the per-layer record, the method configs (one, or a recipe's list; steps recorded before,
    such as a pruned source's, as their dicts) and the source's config and tokenizer files into `out`."""
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith("rope_")}
    if model.lm_head_is_embedding:
        sd.pop("lm_head.weight")  # tied: the same storage as the embedding
    save_file(sd, str(out / "model.safetensors"))
    copy_model_files(source, out)
    write_hf_config(model.config, source, out, str(model.dtype).removeprefix("torch."))  # a pruned model's shape
    configs = configs if isinstance(configs, (list, tuple)) else [configs]
    record = {"format": "leanlm", "version": VERSION, "recipe": recipe_steps(configs),
              "dtype": str(model.dtype).removeprefix("torch."), "layers": records}
    (out / RECORD).write_text(json.dumps(record, indent=1))


def restore_modules(model, path: Path) -> set[str]:
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
