"""The distillation trainer on tiny random teacher and student models: it lowers the KL to the teacher, resumes
bit for bit, keeps a pruned student's zeros, and refuses what cannot work."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import make_hf_model
from leanlm.distillation.trainer import (LOSSES, DistillConfig, Trainer, gradual_sparsity, learning_rate,
                                             plot_history)
from leanlm.compress.registry import decoder_linears
from leanlm.errors import LeanLMError
from leanlm.models.loading import load_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    teacher, student = tmp_path_factory.mktemp("teacher"), tmp_path_factory.mktemp("student")
    make_hf_model("llama", teacher, seed=0)
    make_hf_model("llama", student, seed=1, num_hidden_layers=1)
    return teacher, student


def _models(dirs):
    return load_model(dirs[0], torch.float32), load_model(dirs[1], torch.float32)


IDS = torch.randint(3, 128, (4000,), generator=torch.Generator().manual_seed(0))


def _config(**kw) -> DistillConfig:
    return DistillConfig(**{**dict(batch_size=2, seq_len=16, lr=3e-3, warmup=2, steps=6, eval_tokens=256,
                                   autocast=False), **kw})


def test_training_lowers_the_kl_to_the_teacher(dirs):
    teacher, student = _models(dirs)
    trainer = Trainer(teacher, student, IDS, IDS[-600:], _config(steps=40, eval_every=40))
    history = trainer.run(progress=False)
    first, last = history.evals[0], history.evals[-1]
    assert last["step"] == 40 and last["kl"] < 0.8 * first["kl"]
    assert history.tokens == 40 * 2 * 16


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_every_loss_trains_a_step(dirs, loss):
    teacher, student = _models(dirs)
    before = [p.detach().clone() for p in student.parameters()]
    trainer = Trainer(teacher, student, IDS, None, _config(loss=loss, steps=1, top_k=8))
    trainer.run(progress=False)
    assert math.isfinite(trainer.history.loss[0])
    assert any(not torch.equal(a, b) for a, b in zip(before, student.parameters()))


@pytest.mark.parametrize("extra", [{}, {"prune_to": 0.5, "prune_every": 2, "on_policy": 0.5}, {"loss": "minillm"}])
def test_a_resumed_run_continues_bit_for_bit(dirs, tmp_path, extra):
    teacher, student = _models(dirs)
    Trainer(teacher, student, IDS, None, _config(steps=6, grad_accum=2, **extra)).run(progress=False)
    straight = [p.detach().clone() for p in student.parameters()]

    teacher, student = _models(dirs)
    first = Trainer(teacher, student, IDS, None, _config(steps=6, grad_accum=2, **extra), out=tmp_path)
    while first.step < 3:
        first.train_step()
    first.save_checkpoint(tmp_path)
    teacher, student = _models(dirs)
    second = Trainer(teacher, student, IDS, None, _config(steps=6, grad_accum=2, **extra), out=tmp_path)
    second.load_checkpoint(tmp_path)
    assert second.step == 3 and len(second.history.loss) == 3
    second.run(progress=False)
    assert all(torch.equal(a, b) for a, b in zip(straight, student.parameters()))
    with pytest.raises(LeanLMError, match="lr"):
        Trainer(teacher, student, IDS, None, _config(steps=6, grad_accum=2, lr=1e-2)).load_checkpoint(tmp_path)


def test_a_pruned_student_keeps_its_zeros(dirs):
    teacher, student = _models(dirs)
    w = student.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        w[:, ::2] = 0
    Trainer(teacher, student, IDS, None, _config(steps=3)).run(progress=False)
    assert (w[:, ::2] == 0).all() and (w[:, 1::2] != 0).all()


def test_the_pruning_schedule_is_cubic_from_zero_to_the_target():
    s = [gradual_sparsity(step, 100, 0.6, end=0.5) for step in range(101)]
    assert s[0] == 0.0 and s[50] == s[100] == 0.6 and all(a <= b for a, b in zip(s, s[1:]))
    assert s[25] == pytest.approx(0.6 * (1 - 0.5 ** 3))  # fast early: 7/8 of the way at half the schedule


def test_gradual_pruning_reaches_the_target_in_every_row(dirs):
    teacher, student = _models(dirs)
    trainer = Trainer(teacher, student, IDS, None, _config(steps=8, prune_to=0.5, prune_every=2, prune_end=0.5))
    first = trainer.train_step()
    assert 0 < trainer.sparsity < 0.5
    assert first == Trainer(*_models(dirs), IDS, None, _config(steps=8)).train_step()  # the loss, pruned after
    trainer.run(progress=False)
    for _, linear in decoder_linears(student):
        assert ((linear.weight == 0).sum(1) == linear.weight.shape[1] // 2).all()


def test_gradual_pruning_keeps_a_pruned_students_zeros(dirs):
    teacher, student = _models(dirs)
    w = student.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        w[:, ::2] = 0  # 50% already
    Trainer(teacher, student, IDS, None, _config(steps=4, prune_to=0.75, prune_every=1)).run(progress=False)
    assert (w[:, ::2] == 0).all() and ((w == 0).sum(1) >= 0.75 * w.shape[1]).all()


def test_on_policy_windows_are_the_texts_start_and_the_students_continuation(dirs):
    teacher, student = _models(dirs)
    trainer = Trainer(teacher, student, IDS, None, _config(on_policy=1.0))
    text = Trainer(teacher, student, IDS, None, _config()).batch(0, 0)
    mixed = trainer.batch(0, 0)
    half = text.shape[1] // 2
    assert mixed.shape == text.shape and torch.equal(mixed[:, :half], text[:, :half])
    assert not torch.equal(mixed[:, half:], text[:, half:]) and torch.equal(mixed, trainer.batch(0, 0))
    assert trainer.train_step() > 0


def test_gradient_checkpointing_computes_the_same_step(dirs):
    results = []
    for flag in (False, True):
        teacher, student = _models(dirs)
        Trainer(teacher, student, IDS, None, _config(steps=2, gradient_checkpointing=flag)).run(progress=False)
        results.append([p.detach().clone() for p in student.parameters()])
        assert "forward" not in vars(student.layers[0])  # the blocks' own forward is back
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*results))


def test_the_schedule_warms_up_then_decays_to_zero():
    lrs = [learning_rate(s, 100, 10, 1.0) for s in range(101)]
    assert lrs[0] == 0.1 and lrs[9] == 1.0 and lrs[10] == 1.0
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[100] == 0.0


def test_bad_settings_are_refused(dirs, tmp_path):
    teacher, student = _models(dirs)
    with pytest.raises(LeanLMError, match="unknown distillation loss"):
        _config(loss="mse")
    with pytest.raises(LeanLMError, match="budget"):
        DistillConfig()
    with pytest.raises(LeanLMError, match="on_policy"):
        _config(on_policy=1.5)
    with pytest.raises(LeanLMError, match="sparsity"):
        _config(prune_to=1.0)
    with pytest.raises(LeanLMError, match="no checkpoint"):
        Trainer(teacher, student, IDS, None, _config()).load_checkpoint(tmp_path)
    other = tmp_path / "other"
    make_hf_model("llama", other, vocab_size=100)
    with pytest.raises(LeanLMError, match="same tokenizer"):
        Trainer(teacher, load_model(other, torch.float32), IDS, None, _config())


def test_the_curve_is_drawn(dirs, tmp_path):
    teacher, student = _models(dirs)
    history = Trainer(teacher, student, IDS, IDS[-300:], _config(steps=4, eval_every=2)).run(progress=False)
    plot_history(history, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG" and len(history.evals) == 3


def test_top_k_teacher_logits_are_cached_and_reused(dirs, tmp_path):
    teacher, student = _models(dirs)
    config = _config(loss="topk", top_k=8, steps=3)
    Trainer(teacher, student, IDS, None, config, logit_cache=tmp_path).run(progress=False)
    first = [p.detach().clone() for p in student.parameters()]
    assert len(list(tmp_path.glob("*.safetensors"))) == 3

    calls = []
    teacher, student = _models(dirs)
    teacher.register_forward_hook(lambda *a: calls.append(1))
    Trainer(teacher, student, IDS, None, config, logit_cache=tmp_path).run(progress=False)
    assert not calls  # every step's logits came from the cache
    assert all(torch.equal(a, b) for a, b in zip(first, student.parameters()))


@pytest.mark.parametrize("loss", ["fkl", "jsd", "topk", "slim", "hard", "ce"])
def test_the_chunked_loss_equals_the_whole_logits_loss(dirs, loss, monkeypatch):
    """ChunkedHead scores the logits a few rows at a time (an uneven last chunk here) and takes their gradients in
    the forward pass: loss and every gradient as the plain loss on the whole [B, T, V] logits, the head learning."""
    teacher, student = _models(dirs)
    monkeypatch.setattr("leanlm.distillation.trainer.CHUNK_LOGITS", 5 * student.config.vocab_size)
    trainer = Trainer(teacher, student, IDS, None, _config(loss=loss, top_k=8))
    tokens = trainer.batch(0, 0)  # [2, 17]: 32 rows, chunks of 5
    assert len(trainer.chunks(32)) == 7
    trainer.loss(tokens).backward()
    chunked = {name: p.grad.clone() for name, p in student.named_parameters()}
    chunked_head = student.lm_head.weight.grad.clone()
    value = trainer.loss(tokens).item()
    student.zero_grad()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1])[None].expand_as(inputs)
    target = teacher(inputs, positions).detach()
    if loss in ("topk", "slim"):
        target = target.topk(8, dim=-1)
    whole = LOSSES[loss](student(inputs, positions), target, labels, trainer.config)
    whole.backward()
    assert value == pytest.approx(whole.item(), rel=1e-5)
    assert student.lm_head.weight.requires_grad and chunked_head.abs().sum() > 0  # the head learns through W
    for name, p in student.named_parameters():
        torch.testing.assert_close(chunked[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_student_with_a_quantized_head_is_refused(dirs):
    """Its int8 kernels have no gradient: the trainer says to quantize the head after distilling."""
    from leanlm.compress.quant.rtn import Head, head

    teacher, student = _models(dirs)
    head(student, Head(bits=8))
    with pytest.raises(LeanLMError, match="lm_head is quantized"):
        Trainer(teacher, student, IDS, None, _config())
