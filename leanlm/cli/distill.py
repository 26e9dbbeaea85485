"""`leanlm distill`: train a student on a teacher's distributions (recovering a pruned model, or a smaller one
cut from the teacher's own layers) and save it as an ordinary model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from leanlm.cli.common import Device, _fail, app, err, out


def keep_layers(spec: str, total: int) -> list[int]:
    """"0,5,11" -> those layers; "4" -> four evenly spaced, the first and the last among them."""
    try:
        numbers = [int(part) for part in spec.split(",")]
    except ValueError:
        raise typer.BadParameter(f"--keep-layers takes a count or a comma-separated list of layers, got {spec!r}")
    if len(numbers) == 1:
        n = numbers[0]
        if not 1 <= n <= total:
            raise typer.BadParameter(f"--keep-layers {n}: the teacher has {total} layers")
        return sorted({round(i * (total - 1) / max(1, n - 1)) for i in range(n)})
    if sorted(set(numbers)) != numbers or numbers[0] < 0 or numbers[-1] >= total:
        raise typer.BadParameter(f"--keep-layers: give ascending distinct layers in 0..{total - 1}, got {spec}")
    return numbers


@app.command()
def distill(
    teacher: Annotated[str, typer.Option(help="the teacher: zoo name or model directory")],
    output: Annotated[Path, typer.Option("--output", "-o", help="directory to write (with --resume: the run's)")],
    student: Annotated[Optional[str], typer.Option(help="the student (same tokenizer), e.g. a pruned teacher")] = None,
    student_from: Annotated[Optional[str], typer.Option(help="cut the student from this model's own layers "
                                                             "(with --keep-layers)")] = None,
    keep: Annotated[Optional[str], typer.Option("--keep-layers", help="with --student-from: how many layers "
                                                "(evenly spaced) or which, e.g. 0,4,8,29")] = None,
    loss: Annotated[str, typer.Option(help="fkl, rkl, jsd, skl, srkl, topk, slim, hard (teacher's labels), "
                                           "ce (the text's), tinybert (+ hidden states and attention maps), "
                                           "minillm (sequence-level reverse KL on teacher-mixed samples)")] = "fkl",
    temperature: Annotated[float, typer.Option(help="softmax temperature of the soft losses")] = 1.0,
    top_k: Annotated[int, typer.Option(help="topk, slim: teacher logits kept per position")] = 64,
    data: Annotated[Optional[Path], typer.Option(help="training text file or folder (default: built-in "
                                                      "calibration split)")] = None,
    steps: Annotated[Optional[int], typer.Option(help="budget in optimizer steps")] = None,
    tokens: Annotated[Optional[int], typer.Option(help="budget in training tokens")] = None,
    minutes: Annotated[Optional[float], typer.Option(help="budget in minutes of training")] = None,
    lr: Annotated[float, typer.Option(help="peak learning rate (AdamW, warm-up then cosine)")] = 1e-4,
    batch_size: Annotated[int, typer.Option(help="windows per micro-batch")] = 4,
    seq_len: Annotated[int, typer.Option(help="tokens per window")] = 256,
    grad_accum: Annotated[int, typer.Option(help="micro-batches per optimizer step")] = 1,
    eval_every: Annotated[int, typer.Option(help="evaluate (perplexity, KL to the teacher) every N steps")] = 50,
    eval_data: Annotated[Optional[Path], typer.Option(help="evaluation text file or folder (default: built-in "
                                                           "evaluation split)")] = None,
    eval_tokens: Annotated[int, typer.Option(help="evaluation tokens (the first of --eval-data's)")] = 4096,
    gradient_checkpointing: Annotated[bool, typer.Option(help="recompute activations in the backward pass "
                                                              "(less memory, ~1.3x the time)")] = False,
    logit_cache: Annotated[Optional[Path], typer.Option(help="topk, slim: keep the teacher's top-k logits of each "
                                                             "step here, so later runs skip the teacher")] = None,
    on_policy: Annotated[float, typer.Option(help="share of the windows whose second half the student samples "
                                                  "itself (GKD's on-policy lambda, 0 to 1)")] = 0.0,
    prune_to: Annotated[Optional[float], typer.Option(help="prune while training: each projection row's sparsity "
                                                           "at the end, by magnitude on a cubic schedule")] = None,
    prune_end: Annotated[float, typer.Option(help="with --prune-to: the share of the run by which it is reached")] = 0.75,
    qat: Annotated[Optional[str], typer.Option(help="quantization-aware training for w8, w8a8 or w4g128 (w4g64, "
                                                    "w4g32): saved in leanlm's quantized format")] = None,
    device: Device = "auto",
    resume: Annotated[bool, typer.Option(help="continue the run whose checkpoint is in -o DIR")] = False,
    keep_checkpoint: Annotated[bool, typer.Option(help="keep DIR/checkpoint (float32 weights and optimizer "
                                                       "moments, ~4x the model) to --resume with a larger "
                                                       "budget later")] = False,
) -> None:
    """Distil TEACHER into a student and save it to -o DIR (an ordinary model directory with curve.png and the
    run in distill.json); checkpoints in DIR/checkpoint let --resume continue an interrupted run bit for bit
    (removed when the run ends, unless --keep-checkpoint)."""
    import json
    import shutil
    from dataclasses import asdict, replace

    import torch

    from leanlm.api import load
    from leanlm.compress.distill.qat import QAT, export, prepare
    from leanlm.compress.distill.trainer import DistillConfig, Trainer, plot_history
    from leanlm.compress.quant import format as qformat
    from leanlm.compress.registry import decoder_linears, merge_records, renumber_layers
    from leanlm.compress.sparse.masks import layer_record
    from leanlm.compress.sparse.save import read_record, save_float
    from leanlm.compress.sparse.structured import drop_layers
    from leanlm.eval.datasets import load_text
    from leanlm.lowbit.record import note_pruning
    from leanlm.models.zoo import resolve

    if (student is None) == (student_from is None):
        _fail("give --student MODEL, or --student-from MODEL with --keep-layers")
    if student_from is not None and keep is None:
        _fail("--student-from needs --keep-layers (a count, or which layers)")
    if output.exists() and not resume:
        _fail(f"{output} already exists; choose a new output directory (or --resume a run in it)")
    if resume and not (output / "checkpoint" / "trainer.json").exists():
        _fail(f"--resume: {output} holds no checkpoint")
    qat_config = None if qat is None else QAT.parse(qat)
    config = DistillConfig(loss=loss, temperature=temperature, top_k=top_k, lr=lr, batch_size=batch_size,
                           seq_len=seq_len, grad_accum=grad_accum, steps=steps, tokens=tokens, minutes=minutes,
                           eval_every=eval_every, eval_tokens=eval_tokens, gradient_checkpointing=gradient_checkpointing,
                           on_policy=on_policy, prune_to=prune_to, prune_end=prune_end)
    teacher_net, tok = load(teacher, "bfloat16", device)
    source = resolve(student or student_from)
    student_net, _ = load(source, "float32", device)
    pruning = read_record(source)  # a pruned student's record
    if keep is not None:
        kept = keep_layers(keep, student_net.config.num_layers)
        drop_layers(student_net, kept)
        if loss == "tinybert" and resolve(teacher) == source:  # each kept layer learns from where it came
            config = replace(config, layer_map=tuple(kept))
        if pruning:  # its records follow their layers to the student's numbers, as `leanlm prune --method layers`'s
            pruning["layers"] = renumber_layers(pruning.get("layers", {}), kept)
    if qat_config is not None:
        prepare(student_net, qat_config)
    train_ids = torch.tensor(tok.encode(load_text(data, split="calibration", tokenizer=tok)))
    eval_ids = torch.tensor(tok.encode(load_text(eval_data, split="evaluation", tokenizer=tok)))
    trainer = Trainer(teacher_net, student_net, train_ids, eval_ids, config, out=output, logit_cache=logit_cache)
    if resume:
        trainer.load_checkpoint(output)
    history = trainer.run()
    final = history.evals[-1]
    student_net.cpu()  # saved (and QAT exported onto the CPU kernels' formats) from the CPU
    if prune_to is not None:  # pruned while training: the record says so, as `leanlm prune`'s would
        pruned = {name: layer_record(linear.weight, None) for name, linear in decoder_linears(student_net)}
        pruning = {"recipe": [*pruning.get("recipe", []), {"method": "gradual_magnitude", "sparsity": prune_to,
                                                           "during": "distill"}],
                   "layers": merge_records(pruning.get("layers", {}), pruned)}
    # a pruned student's pruning.json goes along (its sparsity stays true); the run itself goes to distill.json
    if qat_config is None:
        save_float(student_net.to(torch.bfloat16).eval(), source, output, pruning or None)
    else:
        # a pruned student's layers keep their pruning records, merged with their quantization, as quantize does
        records = merge_records(pruning.get("layers", {}), export(student_net, qat_config))
        note_pruning(student_net, records)
        qformat.save(student_net.eval(), records, [*pruning.get("recipe", []), qat_config], source, output)
    run = {"teacher": str(teacher), "student": str(student or student_from), "keep_layers": keep,
           "data": str(data or "built-in calibration split"),
           "eval_data": str(eval_data or "built-in evaluation split"),
           "config": asdict(config), "history": asdict(history)}
    (output / "distill.json").write_text(json.dumps(run, indent=1))
    plot_history(history, output / "curve.png")
    if not keep_checkpoint:
        shutil.rmtree(output / "checkpoint", ignore_errors=True)
    err.print(f"{history.tokens} training tokens in {history.seconds / 60:.1f} min "
              f"({history.tokens / max(history.seconds, 1e-9):.0f} tokens/s)")
    out.print(f"{student or student_from} -> {output} ({config.loss}, {trainer.step} steps: perplexity "
              f"{history.evals[0]['ppl']:.2f} -> {final['ppl']:.2f}, KL to the teacher {history.evals[0]['kl']:.4f}"
              f" -> {final['kl']:.4f})", soft_wrap=True)
