"""`leanlm distill`: train a student on a teacher's distributions (recovering a pruned model, or a smaller one
cut from the teacher's own layers) and save it as an ordinary model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from leanlm.cli.common import Device, _fail, app, err, out
from leanlm.distillation.run import distill as run


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
    if (student is None) == (student_from is None):
        _fail("give --student MODEL, or --student-from MODEL with --keep-layers")
    if student_from is not None and keep is None:
        _fail("--student-from needs --keep-layers (a count, or which layers)")
    if output.exists() and not resume:
        _fail(f"{output} already exists; choose a new output directory (or --resume a run in it)")
    if resume and not (output / "checkpoint" / "trainer.json").exists():
        _fail(f"--resume: {output} holds no checkpoint")
    done = run(teacher, output, student=student, student_from=student_from, keep=keep, data=data,
               eval_data=eval_data, qat=qat, device=device, resume=resume, keep_checkpoint=keep_checkpoint,
               logit_cache=logit_cache, loss=loss, temperature=temperature, top_k=top_k, lr=lr, batch_size=batch_size,
               seq_len=seq_len, grad_accum=grad_accum, steps=steps, tokens=tokens, minutes=minutes,
               eval_every=eval_every, eval_tokens=eval_tokens, gradient_checkpointing=gradient_checkpointing,
               on_policy=on_policy, prune_to=prune_to, prune_end=prune_end)
    history, first, final = done.history, done.history.evals[0], done.history.evals[-1]
    err.print(f"{history.tokens} training tokens in {history.seconds / 60:.1f} min "
              f"({history.tokens / max(history.seconds, 1e-9):.0f} tokens/s)")
    out.print(f"{student or student_from} -> {output} ({done.config.loss}, {done.steps} steps: perplexity "
              f"{first['ppl']:.2f} -> {final['ppl']:.2f}, KL to the teacher {first['kl']:.4f} -> {final['kl']:.4f})",
              soft_wrap=True)
