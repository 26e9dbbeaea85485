"""The public entry points: load a model by name or path, then generate, stream, evaluate."""

from __future__ import annotations

from pathlib import Path

import torch

from leanlm.models.loading import load_model, parse_dtype
from leanlm.models.transformer import Transformer
from leanlm.runtime import default_dtype, resolve_device
from leanlm.tokenizer import Tokenizer


def load(model: str | Path, dtype: str | torch.dtype | None = None, device: str | None = None,
         progress: bool = True) -> tuple[Transformer, Tokenizer]:
    """A zoo name, HF directory or .gguf file -> (model, tokenizer); pulls zoo models on first use."""
    from leanlm.models.zoo import resolve

    path = resolve(str(model), progress=progress)
    dev = resolve_device(device)
    dt = default_dtype(dev) if dtype in (None, "auto") else parse_dtype(dtype)
    return load_model(path, dt, dev), Tokenizer(path)
