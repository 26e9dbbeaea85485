"""Distillation as a recipe step: `- {method: distill, minutes: 10}` after a pruning step wins back what it lost,
before a quantization step freezes the weights (`leanlm prune/quantize --recipe`, and so `leanlm optimize`).

After an `aqlm` step it is AQLM's end-to-end fine-tuning (arXiv 2401.06118, section 3.4): the codes stay, and the
codebooks, row scales and norms learn the teacher's distributions across all blocks at once (the block-by-block
tuning saw one block's output at a time); the embeddings stay as they are. After an int4 step (rtn, gptq, awq, hqq,
autoround: W4A16 or W4A8) it is EfficientQAT's end-to-end step (arXiv 2407.11062): the codes stay, and each group's
scale and mid and the norms learn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from leanlm.distillation.qat import TunedGroups
from leanlm.distillation.trainer import DistillConfig, Trainer
from leanlm.compress.quant.aqlm import TunedCodebook
from leanlm.compress.registry import register
from leanlm.errors import LeanLMError
from leanlm.eval.datasets import load_text
from leanlm.lowbit.codebook import AdditiveLinear
from leanlm.lowbit.record import replace
from leanlm.models.loading import load


@dataclass(frozen=True)
class Distill:
    """teacher: a zoo name or model directory; the CLI fills in the model the recipe starts from (give it for a
    source that was pruned in an earlier run: its teacher is the original). data: a text file or folder (default:
    the built-in calibration split). lr: 1e-4 for float weights, 1e-3 for AQLM's codebooks (the rate of its block
    tuning; on the default model's 2x8 codebooks 40 steps at 1e-3 gave perplexity 38.95, at 3e-4 40.93) and for int4
    groups' relative scales and mids. codes > 0 (after aqlm only) lets the codes learn too: every code_every steps
    PV-tuning's V step re-picks them in at most that share of each layer's groups (on the default model's 2.46-bit
    codebooks, codes 0.01 moved 0.02% of the groups in 200 steps and left the perplexity where it was: README).
    The budget (steps, tokens or minutes) and the rest are DistillConfig's."""

    name: ClassVar[str] = "distill"
    kind: ClassVar[str] = "distill"
    needs_data: ClassVar[bool] = False  # it reads its own training text, not the calibration windows
    teacher: str | None = None
    loss: str = "fkl"
    steps: int | None = None
    tokens: int | None = None
    minutes: float | None = None
    lr: float | None = None
    batch_size: int = 4
    seq_len: int = 256
    temperature: float = 1.0
    top_k: int = 64
    on_policy: float = 0.0
    data: str | None = None
    codes: float = 0.0  # after aqlm: the share of each layer's groups whose codes may change every code_every steps
    code_every: int = 10
    code_step: float = 0.05  # the V step's move, a fraction of the weight's RMS (TunedCodebook.update_codes)

    def __post_init__(self):
        self.trainer_config()  # its errors, when the recipe is read rather than after the earlier steps ran
        if not 0.0 <= self.codes <= 1.0 or self.code_every < 1 or not self.code_step > 0:
            raise LeanLMError(f"distill codes={self.codes}, code_every={self.code_every}, code_step={self.code_step}: "
                              "codes is a share of the groups in [0, 1], code_every a whole number of steps >= 1, "
                              "code_step > 0")

    def trainer_config(self, quantized: bool = False) -> DistillConfig:
        lr = self.lr if self.lr is not None else 1e-3 if quantized else 1e-4
        return DistillConfig(loss=self.loss, steps=self.steps, tokens=self.tokens, minutes=self.minutes, lr=lr,
                             batch_size=self.batch_size, seq_len=self.seq_len, temperature=self.temperature,
                             top_k=self.top_k, on_policy=self.on_policy)


@torch.no_grad()
def update_codes(trainer: Trainer, books: list[TunedCodebook], config: Distill) -> None:
    """PV-tuning's V step on every AQLM layer at once (TunedCodebook.update_codes), its move halved until the loss
    on the step's batch falls (four tries; else the codes stay): many groups changing together leave the first-order
    model that makes each change alone a descent."""
    tokens = trainer.batch(trainer.step, 0)
    before, kept, move = trainer.loss(tokens).item(), [t.codes for t in books], config.code_step
    for _ in range(4):
        for t in books:
            t.update_codes(move, config.codes)
        if trainer.loss(tokens).item() < before:
            break
        for t, codes in zip(books, kept):
            t.codes = codes
        move /= 2
    for t in books:
        t.track_gradient()


@register(Distill)
def distill(model, config: Distill, progress=None, samples=None) -> dict[str, dict]:
    """Train `model` in place on the teacher's distributions; its zeros stay (the trainer's masks). A model with
    additive-codebook or int4 decoder layers trains their codebooks, scales (and int4 mids) and its norms, nothing
    else."""
    if config.teacher is None:
        raise LeanLMError("a distill step needs a teacher: give `teacher: MODEL` in the step")
    tuned = {name: TunedCodebook.of(m) if isinstance(m, AdditiveLinear) else TunedGroups(m)
             for name, m in model.named_modules() if name.startswith("layers.")
             and (isinstance(m, AdditiveLinear) or getattr(m, "SCHEME", None) in ("w4a16", "w4a8"))}
    frozen = [name for name, m in model.named_modules()
              if name.startswith("layers.") and hasattr(m, "BITS") and name not in tuned]
    if frozen:
        raise LeanLMError(f"a distill step trains float weights, AQLM's codebooks or int4 groups' scales, but "
                          f"{frozen[0]} is quantized otherwise: put the distill step before the quantization steps")
    books = [t for t in tuned.values() if isinstance(t, TunedCodebook)]
    if config.codes and (not books or len(books) < len(tuned)):
        raise LeanLMError("distill codes: the codes learn for AQLM's codebooks only: put the step right after an "
                          "aqlm step, or leave codes at 0")
    teacher, tok = load(config.teacher, "bfloat16", str(next(model.parameters()).device), progress=False)
    ids = torch.tensor(tok.encode(load_text(config.data, split="calibration", tokenizer=tok)))  # chats too
    dtype = model.dtype
    for name, t in tuned.items():
        replace(model, name, t)
    learns = {f"{name}.{p}" for name, t in tuned.items() for p, v in t.named_parameters() if v.requires_grad}
    trains = (lambda name: name in learns or name.endswith("norm.weight")) if tuned else (lambda name: True)
    after_step = None
    if config.codes:
        for t in books:
            t.track_gradient()

        def after_step(trainer: Trainer) -> None:
            if (trainer.step + 1) % config.code_every == 0:
                update_codes(trainer, books, config)

    Trainer(teacher, model, ids, None, config.trainer_config(bool(tuned)), trains=trains,
            after_step=after_step).run(progress=False)
    for name, t in tuned.items():
        replace(model, name, t.pack())
    model.to(dtype).eval().requires_grad_(False)
    return {}
