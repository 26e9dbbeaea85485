"""The distill recipe step: it wins back what a pruning step lost (zeros kept), runs inside `leanlm prune --recipe`
with the source as its teacher, and refuses to come after quantization."""

from __future__ import annotations

import json

import pytest
import torch

from leanlm.compress.registry import apply
from leanlm.pipeline import make_config
from leanlm.errors import LeanLMError
from leanlm.eval.perplexity import score
from leanlm.models.loading import load_model
from leanlm.tokenizer import Tokenizer
from tests.test_cli import leanlm


def _text(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. hello world, hello there. " * 40)
    return path


def _kl(student, teacher, ids) -> float:
    return score(student, ids, teacher, window=64)[1].kl


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


def test_a_distill_step_after_quantization_or_without_a_budget_is_refused(tiny_dir):
    model = load_model(tiny_dir, torch.bfloat16)
    apply(model, make_config("rtn", {"bits": 8}))
    with pytest.raises(LeanLMError, match="before the quantization steps"):
        apply(model, make_config("distill", {"teacher": str(tiny_dir), "steps": 1}))
    with pytest.raises(LeanLMError, match="budget"):
        make_config("distill", {"teacher": str(tiny_dir)})
    with pytest.raises(LeanLMError, match="needs a teacher"):
        apply(model, make_config("distill", {"steps": 1}))
