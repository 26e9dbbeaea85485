"""Distillation as a recipe step: `- {method: distill, minutes: 10}` after a pruning step wins back what it lost,
before a quantization step freezes the weights (`leanlm prune/quantize --recipe`, and so `leanlm optimize`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from leanlm.distillation.trainer import DistillConfig, Trainer
from leanlm.compress.registry import register
from leanlm.errors import LeanLMError
from leanlm.eval.datasets import load_text
from leanlm.models.loading import load


@dataclass(frozen=True)
class Distill:
    """teacher: a zoo name or model directory; the CLI fills in the model the recipe starts from (give it for a
    source that was pruned in an earlier run: its teacher is the original). data: a text file or folder (default:
    the built-in calibration split). The budget (steps, tokens or minutes) and the rest are DistillConfig's."""

    name: ClassVar[str] = "distill"
    kind: ClassVar[str] = "distill"
    needs_data: ClassVar[bool] = False  # it reads its own training text, not the calibration windows
    teacher: str | None = None
    loss: str = "fkl"
    steps: int | None = None
    tokens: int | None = None
    minutes: float | None = None
    lr: float = 1e-4
    batch_size: int = 4
    seq_len: int = 256
    temperature: float = 1.0
    top_k: int = 64
    on_policy: float = 0.0
    data: str | None = None

    def __post_init__(self):
        self.trainer_config()  # its errors, when the recipe is read rather than after the earlier steps ran

    def trainer_config(self) -> DistillConfig:
        return DistillConfig(loss=self.loss, steps=self.steps, tokens=self.tokens, minutes=self.minutes, lr=self.lr,
                             batch_size=self.batch_size, seq_len=self.seq_len, temperature=self.temperature,
                             top_k=self.top_k, on_policy=self.on_policy)


@register(Distill)
def distill(model, config: Distill, progress=None, samples=None) -> dict[str, dict]:
    """Train `model` in place on the teacher's distributions; its zeros stay (the trainer's masks)."""
    if config.teacher is None:
        raise LeanLMError("a distill step needs a teacher: give `teacher: MODEL` in the step")
    frozen = [name for name, m in model.named_modules() if name.startswith("layers.") and hasattr(m, "BITS")]
    if frozen:
        raise LeanLMError(f"a distill step trains float weights, but {frozen[0]} is already quantized: put the "
                          "distill step before the quantization steps")
    teacher, tok = load(config.teacher, "bfloat16", str(next(model.parameters()).device), progress=False)
    ids = torch.tensor(tok.encode(load_text(config.data, split="calibration", tokenizer=tok)))  # chats too
    dtype = model.dtype
    Trainer(teacher, model, ids, None, config.trainer_config()).run(progress=False)
    model.to(dtype).eval().requires_grad_(False)
    return {}
