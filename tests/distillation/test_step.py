"""The distill recipe step: it wins back what a pruning step lost (zeros kept), runs inside `leanlm prune --recipe`
with the source as its teacher, fine-tunes AQLM's codebooks end to end after an aqlm step and int4 groups' scales
and mids after an int4 step (codes and embeddings kept), and refuses to come after any other quantization."""

from __future__ import annotations

import json

import pytest
import torch

from leanlm.compress.registry import apply
from leanlm.pipeline import make_config
from leanlm.errors import LeanLMError
from leanlm.eval.perplexity import score
from leanlm.compress.quant.aqlm import TunedCodebook
from leanlm.distillation.qat import TunedGroups
from leanlm.distillation.step import update_codes
from leanlm.distillation.trainer import Trainer
from leanlm.lowbit.codebook import AdditiveLinear
from leanlm.lowbit.linear import W4A8Linear, W4A16Linear
from leanlm.lowbit.record import replace
from leanlm.models.loading import load_model
from leanlm.tokenizer import Tokenizer
from tests.test_cli import leanlm


def _text(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. hello world, hello there. " * 40)
    return path


def _kl(student, teacher, ids) -> float:
    return score(student, ids, teacher, window=64)[1].kl


def _aqlm_student(tiny_dir, tmp_path, dtype, bits: int = 1):
    """(float teacher, its quick AQLM student in dtype, the training text's path, its token ids)"""
    teacher, student = load_model(tiny_dir, torch.float32), load_model(tiny_dir, dtype)
    text = _text(tmp_path)
    ids = torch.tensor(Tokenizer(tiny_dir).encode(text.read_text()))
    apply(student, make_config("aqlm", {"bits": bits, "iters": 0, "rounds": 1, "fit_steps": 2, "kmeans_iters": 2}),
          samples=ids[:256].reshape(8, 32))
    return teacher, student, text, ids


def test_a_distill_step_wins_back_what_pruning_lost(tiny_dir, tmp_path):
    teacher, student = load_model(tiny_dir, torch.float32), load_model(tiny_dir, torch.bfloat16)
    apply(student, make_config("magnitude", {"sparsity": 0.5}))
    zeros = {name: p == 0 for name, p in student.named_parameters() if (p == 0).any()}
    text = _text(tmp_path)
    ids = torch.tensor(Tokenizer(tiny_dir).encode(text.read_text()))[:512]  # the KL where it trained
    before = _kl(student, teacher, ids)
    step = make_config("distill", {"teacher": str(tiny_dir), "steps": 30, "lr": 1e-3, "batch_size": 2,
                                   "seq_len": 16, "data": str(text)})
    assert apply(student, step) == {}
    assert student.dtype == torch.bfloat16 and not any(p.requires_grad for p in student.parameters())
    assert all((student.get_parameter(name)[mask] == 0).all() for name, mask in zeros.items())
    assert _kl(student, teacher, ids) < 0.6 * before


def test_after_aqlm_a_distill_step_tunes_the_codebooks_scales_and_norms_only(tiny_dir, tmp_path):
    teacher, student, text, ids = _aqlm_student(tiny_dir, tmp_path, torch.bfloat16)
    before = {name: t.clone() for name, t in student.state_dict().items()}
    kl = _kl(student, teacher, ids[:512])
    step = make_config("distill", {"teacher": str(tiny_dir), "steps": 30, "lr": 1e-2, "batch_size": 2,
                                   "seq_len": 16, "data": str(text)})
    assert apply(student, step) == {}
    layers = {name: m for name, m in student.named_modules() if isinstance(m, AdditiveLinear)}
    assert len(layers) == 4 * student.config.num_layers  # qkv, o, gate_up, down: packed again for the kernel
    after = student.state_dict()
    assert after.keys() == before.keys() and student.dtype == torch.bfloat16
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    assert all(name.endswith((".codebooks", ".scales", "norm.weight")) for name in changed)
    assert {name.split(".")[-1] for name in changed} == {"codebooks", "scales", "weight"}
    assert _kl(student, teacher, ids[:512]) < 0.8 * kl


def test_with_codes_a_distill_step_after_aqlm_moves_some_codes_too(tiny_dir, tmp_path):
    teacher, student, text, ids = _aqlm_student(tiny_dir, tmp_path, torch.bfloat16)
    before = {name: t.clone() for name, t in student.state_dict().items()}
    kl = _kl(student, teacher, ids[:512])
    step = make_config("distill", {"teacher": str(tiny_dir), "steps": 30, "lr": 1e-2, "batch_size": 2,
                                   "seq_len": 16, "data": str(text), "codes": 0.02, "code_every": 5, "code_step": 0.01})
    apply(student, step)
    after = student.state_dict()
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    assert {name.split(".")[-1] for name in changed} == {"codes", "codebooks", "scales", "weight"}
    assert all(name.endswith((".codes", ".codebooks", ".scales", "norm.weight")) for name in changed)
    for name in (n for n in after if n.endswith(".codes")):  # six updates of at most 2% of the groups each
        moved = (after[name] != before[name]).any(1).float().mean().item()
        assert moved <= 6 * 0.02 + 1e-6
    assert _kl(student, teacher, ids[:512]) < kl


@pytest.mark.parametrize("move", [0.01, 1.0])
def test_a_code_update_keeps_only_moves_that_lower_the_loss_of_its_batch(tiny_dir, tmp_path, move):
    teacher, student, _, ids = _aqlm_student(tiny_dir, tmp_path, torch.float32, bits=2)
    books = {name: TunedCodebook.of(m) for name, m in student.named_modules() if isinstance(m, AdditiveLinear)}
    for name, t in books.items():
        replace(student, name, t)
        t.track_gradient()
    config = make_config("distill", {"teacher": str(tiny_dir), "steps": 1, "batch_size": 4, "seq_len": 64,
                                     "codes": 0.05, "code_step": move})
    trainer = Trainer(teacher, student, ids, None, config.trainer_config(True),
                      trains=lambda name: name.endswith(".books"))
    tokens = trainer.batch(0, 0)
    with torch.no_grad():
        before, codes = trainer.loss(tokens).item(), [t.codes for t in books.values()]
    trainer.loss(tokens).backward()  # the gradient the update follows
    update_codes(trainer, list(books.values()), config)
    with torch.no_grad():
        after = trainer.loss(tokens).item()
    moved = sum((t.codes != c).any(1).sum().item() for t, c in zip(books.values(), codes))
    assert after < before if moved else after == before
    if move == 0.01:  # a small move is a descent: it is kept
        assert moved > 0


@pytest.mark.parametrize("rotated,options", [(False, {}), (False, {"symmetric": True}), (False, {"act_bits": 8}),
                                             (True, {"act_bits": 8})],
                         ids=["w4a16", "symmetric", "w4a8", "rotated-w4a8"])
def test_after_int4_a_distill_step_tunes_group_scales_mids_and_norms_only(tiny_dir, tmp_path, rotated, options):
    teacher, student = load_model(tiny_dir, torch.float32), load_model(tiny_dir, torch.bfloat16)
    text = _text(tmp_path)
    ids = torch.tensor(Tokenizer(tiny_dir).encode(text.read_text()))
    if rotated:  # QuaRot's W4A8, its online rotation (made while scoring below, under inference_mode) trained through
        apply(student, make_config("rotate", {"online": True}))
    apply(student, make_config("rtn", {"bits": 4, "group_size": 32, **options}))
    kind = W4A8Linear if options.get("act_bits") else W4A16Linear
    layer = student.layers[0].mlp.down_proj
    assert type(layer) is kind
    x = torch.randn(3, layer.in_features)
    assert torch.allclose(TunedGroups(layer)(x), layer(x).float(), atol=1e-2, rtol=1e-2)  # the same grid
    before = {name: t.clone() for name, t in student.state_dict().items()}
    kl = _kl(student, teacher, ids[:512])
    step = make_config("distill", {"teacher": str(tiny_dir), "steps": 30, "lr": 3e-2, "batch_size": 2,
                                   "seq_len": 16, "data": str(text)})
    assert apply(student, step) == {}
    assert sum(type(m) is kind for m in student.modules()) == 4 * student.config.num_layers  # qkv, o, gate_up, down
    after = student.state_dict()
    assert after.keys() == before.keys() and student.dtype == torch.bfloat16
    changed = {name.split(".")[-1] for name in after if not torch.equal(after[name], before[name])}
    assert changed == ({"scales", "weight"} if options.get("symmetric") else {"scales", "zeros", "weight"})
    assert _kl(student, teacher, ids[:512]) < 0.8 * kl


def test_a_recipe_distills_between_pruning_and_quantization(tiny_dir, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"- {{method: magnitude, sparsity: 0.5}}\n- {{method: distill, steps: 2, batch_size: 2, "
                      f"seq_len: 16, data: {_text(tmp_path)}}}\n- {{method: rtn, bits: 8}}\n")
    out = tmp_path / "out"
    r = leanlm("prune", tiny_dir, "--recipe", recipe, "-o", out)
    assert r.returncode == 0, r.stderr
    steps = json.loads((out / "quantization.json").read_text())["recipe"]
    assert [s["method"] for s in steps] == ["magnitude", "distill", "rtn"]
    assert steps[1]["teacher"] == str(tiny_dir)  # the source, filled in by the CLI


def test_a_quantize_recipe_fine_tunes_aqlm_end_to_end_and_its_model_loads(tiny_dir, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("- {method: aqlm, bits: 1, iters: 0, rounds: 1, fit_steps: 2, kmeans_iters: 2}\n"
                      f"- {{method: distill, steps: 2, batch_size: 2, seq_len: 16, data: {_text(tmp_path)}}}\n")
    out = tmp_path / "out"
    r = leanlm("quantize", tiny_dir, "--recipe", recipe, "--samples", "8", "--seq-len", "32", "-o", out)
    assert r.returncode == 0, r.stderr
    steps = json.loads((out / "quantization.json").read_text())["recipe"]
    assert [s["method"] for s in steps][:2] == ["aqlm", "distill"] and steps[1]["teacher"] == str(tiny_dir)
    model = load_model(out, torch.bfloat16)
    assert sum(isinstance(m, AdditiveLinear) for m in model.modules()) == 4 * model.config.num_layers
    logits = model(torch.tensor([[1, 5, 9]]), torch.arange(3)[None])
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


def test_a_distill_step_after_quantization_or_without_a_budget_is_refused(tiny_dir):
    model = load_model(tiny_dir, torch.bfloat16)
    apply(model, make_config("rtn", {"bits": 8}))
    with pytest.raises(LeanLMError, match="quantized otherwise"):
        apply(model, make_config("distill", {"teacher": str(tiny_dir), "steps": 1}))
    with pytest.raises(LeanLMError, match="budget"):
        make_config("distill", {"teacher": str(tiny_dir)})
    with pytest.raises(LeanLMError, match="needs a teacher"):
        apply(model, make_config("distill", {"steps": 1}))
    with pytest.raises(LeanLMError, match="share of the groups"):
        make_config("distill", {"teacher": str(tiny_dir), "steps": 1, "codes": 1.5})
    int4 = load_model(tiny_dir, torch.bfloat16)
    apply(int4, make_config("rtn", {"bits": 4, "group_size": 32}))
    with pytest.raises(LeanLMError, match="AQLM's codebooks only"):
        apply(int4, make_config("distill", {"teacher": str(tiny_dir), "steps": 1, "codes": 0.01}))
