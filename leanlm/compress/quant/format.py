"""Writing a quantized model: our state dict in safetensors plus quantization.json naming each layer's scheme
(lowbit.record reads it back)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from leanlm.compress.registry import recipe_steps
from leanlm.lowbit.record import RECORD, VERSION
from leanlm.models.config import write_hf_config

COPIED = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


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
