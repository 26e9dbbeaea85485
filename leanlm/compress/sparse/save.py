"""A float (possibly pruned, possibly smaller) model written as an ordinary Hugging Face model directory, so every
leanlm verb and `transformers` load it: HF-named safetensors, config.json with the model's current shape,
the source's tokenizer files, and what the pruning did in pruning.json."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from leanlm.compress.quant.format import copy_model_files
from leanlm.errors import LeanLMError
from leanlm.models.config import write_hf_config
from leanlm.models.loading import leanlm_to_hf

RECORD = "pruning.json"


def save_float(model, source: Path, out: Path, record: dict | None = None) -> None:
    """Write `model` (a float Transformer; `model.config` must describe its current shape) into the existing
    directory `out`, with `source`'s tokenizer files and its config.json updated to model.config; `record`
    (e.g. {"recipe": [...], "layers": {name: {...}}}) goes to pruning.json."""
    if any(hasattr(m, "BITS") for m in model.modules()):
        raise LeanLMError("the model holds quantized layers; save it with leanlm.compress.quant.format.save")
    out = Path(out)
    save_file(leanlm_to_hf(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    copy_model_files(source, out)
    write_hf_config(model.config, source, out, str(model.dtype).removeprefix("torch."))
    if record is not None:
        (out / RECORD).write_text(json.dumps(record, indent=1))


def read_record(path: Path) -> dict:
    """What pruned the model at `path`: its pruning.json ({"recipe": [...], "layers": {...}}), {} when it has
    none."""
    file = Path(path) / RECORD
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise LeanLMError(f"{file}: not valid JSON ({e}); prune the model again") from None
