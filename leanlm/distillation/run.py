"""A distillation run as a library call: load the teacher and the student (or cut the student from a model's own
layers), train (optionally pruning or quantization-aware), and save the student as an ordinary model directory
(or in leanlm's quantized format after QAT) with the run in distill.json and its curve in curve.png.
`leanlm distill` and `leanlm.distill(...)` both run it."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from leanlm.compress.quant import format as qformat
from leanlm.compress.registry import decoder_linears, merge_records, renumber_layers
from leanlm.compress.sparse.masks import layer_record
from leanlm.compress.sparse.save import read_record, save_float
from leanlm.compress.sparse.structured import drop_layers
from leanlm.distillation.qat import QAT, export, prepare
from leanlm.distillation.trainer import DistillConfig, History, Trainer, plot_history
from leanlm.errors import LeanLMError
from leanlm.eval.datasets import load_text
from leanlm.lowbit.record import note_pruning
from leanlm.models.loading import load
from leanlm.models.zoo import resolve


def keep_layers(spec: str | int | list[int], total: int) -> list[int]:
    """"0,5,11" (or [0, 5, 11]) -> those layers; "4" (or 4) -> four evenly spaced, the first and the last among
    them."""
    try:
        numbers = [int(part) for part in (str(spec).split(",") if isinstance(spec, (str, int)) else spec)]
    except ValueError:
        raise LeanLMError(f"keep_layers takes a count or a comma-separated list of layers, got {spec!r}") from None
    if len(numbers) == 1:
        n = numbers[0]
        if not 1 <= n <= total:
            raise LeanLMError(f"keep_layers {n}: the model has {total} layers")
        return sorted({round(i * (total - 1) / max(1, n - 1)) for i in range(n)})
    if sorted(set(numbers)) != numbers or numbers[0] < 0 or numbers[-1] >= total:
        raise LeanLMError(f"keep_layers: give ascending distinct layers in 0..{total - 1}, got {spec}")
    return numbers


@dataclass
class Distilled:
    """What a run wrote: the directory, the student as saved (on the CPU), the training history and config."""

    path: Path
    model: torch.nn.Module
    history: History
    config: DistillConfig
    steps: int


def distill(teacher: str | Path, out: str | Path, *, student: str | Path | None = None,
            student_from: str | Path | None = None, keep: str | int | list[int] | None = None, data=None,
            eval_data=None, qat: str | None = None, device: str = "auto", resume: bool = False,
            keep_checkpoint: bool = False, logit_cache=None, progress: bool = True, **options) -> Distilled:
    """leanlm.distill("qwen2.5-coder-0.5b", "small", student_from="qwen2.5-coder-0.5b", keep=12, minutes=10):
    train a student on the teacher's distributions and save it to `out`. `options` are DistillConfig's (loss,
    steps / tokens / minutes, lr, batch_size, seq_len, on_policy, prune_to, ...); `qat` is w8, w8a8 or w4g128.
    Checkpoints in out/checkpoint let `resume=True` continue an interrupted run bit for bit."""
    out = Path(out)
    if (student is None) == (student_from is None):
        raise LeanLMError("give a student, or student_from with keep (the layers to keep)")
    if student_from is not None and keep is None:
        raise LeanLMError("student_from needs keep (a count, or which layers)")
    if out.exists() and not resume:
        raise LeanLMError(f"{out} already exists; choose a new output directory (or resume the run in it)")
    if resume and not (out / "checkpoint" / "trainer.json").exists():
        raise LeanLMError(f"resume: {out} holds no checkpoint")
    known = {f.name for f in fields(DistillConfig)}
    if unknown := sorted(set(options) - known):
        raise LeanLMError(f"distill has no option {', '.join(unknown)} (its options: {', '.join(sorted(known))})")
    qat_config = None if qat is None else QAT.parse(qat)
    config = DistillConfig(**options)
    teacher_net, tok = load(teacher, "bfloat16", device, progress=progress)
    source = resolve(str(student or student_from))
    student_net, _ = load(source, "float32", device, progress=progress)
    pruning = read_record(source)  # a pruned student's record
    if keep is not None:
        kept = keep_layers(keep, student_net.config.num_layers)
        drop_layers(student_net, kept)
        if config.loss == "tinybert" and resolve(str(teacher)) == source:  # each kept layer learns from where it came
            config = replace(config, layer_map=tuple(kept))
        if pruning:  # its records follow their layers to the student's numbers, as `leanlm prune --method layers`'s
            pruning["layers"] = renumber_layers(pruning.get("layers", {}), kept)
    if qat_config is not None:
        prepare(student_net, qat_config)
    train_ids = torch.tensor(tok.encode(load_text(data, split="calibration", tokenizer=tok)))
    eval_ids = torch.tensor(tok.encode(load_text(eval_data, split="evaluation", tokenizer=tok)))
    trainer = Trainer(teacher_net, student_net, train_ids, eval_ids, config, out=out, logit_cache=logit_cache)
    if resume:
        trainer.load_checkpoint(out)
    history = trainer.run(progress=progress)
    student_net.cpu().eval().requires_grad_(False)  # saved (QAT exported onto the CPU kernels' formats) from the CPU
    if config.prune_to is not None:  # pruned while training: the record says so, as `leanlm prune`'s would
        pruned = {name: layer_record(linear.weight, None) for name, linear in decoder_linears(student_net)}
        pruning = {"recipe": [*pruning.get("recipe", []), {"method": "gradual_magnitude", "sparsity": config.prune_to,
                                                           "during": "distill"}],
                   "layers": merge_records(pruning.get("layers", {}), pruned)}
    # a pruned student's pruning.json goes along (its sparsity stays true); the run itself goes to distill.json
    if qat_config is None:
        student_net = student_net.to(torch.bfloat16)
        save_float(student_net, source, out, pruning or None)
    else:
        # a pruned student's layers keep their pruning records, merged with their quantization, as quantize does
        records = merge_records(pruning.get("layers", {}), export(student_net, qat_config))
        note_pruning(student_net, records)
        qformat.save(student_net, records, [*pruning.get("recipe", []), qat_config], source, out)
    run = {"teacher": str(teacher), "student": str(student or student_from), "keep_layers": keep,
           "data": str(data or "built-in calibration split"),
           "eval_data": str(eval_data or "built-in evaluation split"),
           "config": asdict(config), "history": asdict(history)}
    (out / "distill.json").write_text(json.dumps(run, indent=1))
    plot_history(history, out / "curve.png")
    if not keep_checkpoint:
        shutil.rmtree(out / "checkpoint", ignore_errors=True)
    return Distilled(out, student_net, history, config, trainer.step)
