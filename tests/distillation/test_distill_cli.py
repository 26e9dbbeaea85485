"""`leanlm distill` as a user runs it: a student cut from the teacher's layers trains, saves as an ordinary model
directory with its curve and run record, and an interrupted run resumes; bad input is one clear line."""

from __future__ import annotations

import json

import pytest
import torch

from leanlm.distillation.trainer import DistillConfig
from leanlm.models.loading import load_model
from tests.test_cli import leanlm


def _text(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. hello world, hello there. " * 40)
    return path


def _pruned(tiny_dir, out):
    """tiny_dir with half of every projection's weights zeroed, and its pruning.json."""
    from leanlm.compress.registry import apply
    from leanlm.pipeline import make_config
    from leanlm.compress.sparse.save import save_float

    model = load_model(tiny_dir, torch.float32)
    config = make_config("magnitude", {"sparsity": 0.5})
    out.mkdir()
    save_float(model, tiny_dir, out, {"recipe": [], "layers": apply(model, config)})
    return out


def test_a_student_cut_from_the_teacher_trains_saves_and_resumes(tiny_dir, tmp_path):
    """The student is cut from a pruned copy of the teacher: its pruning.json goes along, named by the student's
    layers."""
    out = tmp_path / "student"
    args = ("distill", "--teacher", tiny_dir, "--student-from", _pruned(tiny_dir, tmp_path / "pruned"),
            "--keep-layers", "1", "--data",
            _text(tmp_path), "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "128", "--eval-every", "2", "--lr", "1e-3", "-o", out)
    r = leanlm(*args, "--steps", "2", "--keep-checkpoint")
    assert r.returncode == 0, r.stderr
    assert (out / "checkpoint" / "trainer.json").exists()
    assert "perplexity" in r.stdout and "distilling" not in r.stdout  # the bar went to stderr
    model = load_model(out, torch.float32)
    assert model.config.num_layers == 1 and json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    layers = json.loads((out / "pruning.json").read_text())["layers"]
    assert layers and all(name.startswith("layers.0.") for name in layers)  # layer 1 is gone, and its records
    run = json.loads((out / "distill.json").read_text())
    assert run["history"]["steps"] == [0, 1] and (out / "curve.png").exists()
    r = leanlm(*args, "--steps", "4", "--resume")  # a larger budget: two more steps from the checkpoint
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "distill.json").read_text())["history"]["steps"] == [0, 1, 2, 3]
    assert not (out / "checkpoint").exists()  # a finished run leaves the model, not its optimizer state


def test_qat_saves_a_quantized_model_that_keeps_its_pruning(tiny_dir, tmp_path):
    import json

    from leanlm.compress.sparse.masks import decoder_sparsity
    from leanlm.lowbit.record import RECORD, is_quantized

    pruned, out = _pruned(tiny_dir, tmp_path / "pruned"), tmp_path / "qat"
    r = leanlm("distill", "--teacher", tiny_dir, "--student", pruned, "--qat", "w4g32", "--data", _text(tmp_path),
               "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "128", "--steps", "2", "-o", out)
    assert r.returncode == 0, r.stderr
    assert is_quantized(out)
    record = json.loads((out / RECORD).read_text())
    assert [step["method"] for step in record["recipe"]] == ["qat"]  # _pruned saved an empty recipe
    assert all(rec["scheme"] == "w4a16" and rec["sparsity"] == 0.5 for name, rec in record["layers"].items()
               if name.startswith("layers."))
    model = load_model(out, torch.bfloat16)
    assert {type(m).__name__ for m in model.modules()} >= {"W4A16Linear"}
    assert abs(decoder_sparsity(model)[0] - 0.5) < 0.01


def test_pruning_while_distilling_saves_the_sparsity_and_says_so(tiny_dir, tmp_path):
    from leanlm.compress.sparse.masks import decoder_sparsity

    out = tmp_path / "gmp"
    r = leanlm("distill", "--teacher", tiny_dir, "--student", tiny_dir, "--prune-to", "0.5", "--on-policy", "0.5",
               "--data", _text(tmp_path), "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "128",
               "--steps", "3", "-o", out)
    assert r.returncode == 0, r.stderr
    record = json.loads((out / "pruning.json").read_text())
    assert record["recipe"][-1] == {"method": "gradual_magnitude", "sparsity": 0.5, "during": "distill"}
    assert all(rec["sparsity"] == 0.5 for rec in record["layers"].values())
    assert decoder_sparsity(load_model(out, torch.float32))[0] == 0.5


def test_a_cut_student_learns_tinybert_style_from_the_layers_it_kept(tiny_dir, tmp_path):
    out = tmp_path / "tb"
    r = leanlm("distill", "--teacher", tiny_dir, "--student-from", tiny_dir, "--keep-layers", "1", "--loss",
               "tinybert", "--data", _text(tmp_path), "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "128",
               "--steps", "2", "-o", out)
    assert r.returncode == 0, r.stderr
    run = json.loads((out / "distill.json").read_text())
    assert run["config"]["layer_map"] == [0] and len(run["history"]["loss"]) == 2


def test_eval_data_is_what_the_student_is_scored_on(tiny_dir, tmp_path):
    """--eval-data replaces the built-in evaluation split (so that a run needs no download), and the run says so."""
    other = tmp_path / "eval.txt"
    other.write_text("def f(x): return x + 1\n" * 60)
    first = {}
    for name, evaluation in (("same", _text(tmp_path)), ("other", other)):
        out = tmp_path / name
        r = leanlm("distill", "--teacher", tiny_dir, "--student", tiny_dir, "--data", _text(tmp_path),
                   "--eval-data", evaluation, "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                   "--eval-tokens", "128", "-o", out)
        assert r.returncode == 0, r.stderr
        run = json.loads((out / "distill.json").read_text())
        assert run["eval_data"] == str(evaluation)
        first[name] = run["history"]["evals"][0]
    assert first["same"]["kl"] < 1e-6 and first["other"]["kl"] < 1e-6  # the student starts as the teacher
    assert first["same"]["ppl"] != pytest.approx(first["other"]["ppl"], rel=1e-3)


def test_bad_input_is_one_clear_line(tiny_dir, tmp_path):
    r = leanlm("distill", "--teacher", tiny_dir, "--steps", "1", "-o", tmp_path / "x")
    assert r.returncode != 0 and "--student" in r.stderr and "Traceback" not in r.stderr
    r = leanlm("distill", "--teacher", tiny_dir, "--student", tiny_dir, "--loss", "mse", "--steps", "1",
               "-o", tmp_path / "y")
    assert r.returncode != 0 and "unknown distillation loss" in r.stderr and not (tmp_path / "y").exists()
    r = leanlm("distill", "--teacher", tiny_dir, "--student-from", tiny_dir, "--keep-layers", "9", "--steps", "1",
               "-o", tmp_path / "z")
    assert r.returncode != 0 and "has 2 layers" in r.stderr and not (tmp_path / "z").exists()
    assert DistillConfig(steps=1).loss == "fkl"


def test_the_library_call_writes_what_the_verb_writes(tiny_dir, tmp_path):
    """leanlm.distill(...) is the verb's run: same student weights (the run is seeded), the model handed back is
    the one saved; a bad option is one clear error before any model loads."""
    from leanlm import distill
    from leanlm.errors import LeanLMError

    text = _text(tmp_path)
    options = dict(steps=2, batch_size=2, seq_len=16, eval_tokens=64, lr=1e-3)
    done = distill(tiny_dir, tmp_path / "lib", student_from=tiny_dir, keep=1, data=text, progress=False, **options)
    r = leanlm("distill", "--teacher", tiny_dir, "--student-from", tiny_dir, "--keep-layers", "1", "--data", text,
               "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-tokens", "64", "--lr", "1e-3",
               "-o", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    lib, cli = load_model(tmp_path / "lib", torch.float32), load_model(tmp_path / "cli", torch.float32)
    assert lib.config.num_layers == 1 and done.steps == 2 and len(done.history.evals) >= 2
    for (name, a), b in zip(lib.state_dict().items(), cli.state_dict().values()):
        assert torch.equal(a, b), name
    ids, positions = torch.tensor([[1, 5, 9]]), torch.arange(3)[None]
    assert torch.equal(done.model(ids, positions), load_model(tmp_path / "lib", torch.bfloat16)(ids, positions))
    with pytest.raises(LeanLMError, match="no option stepz"):
        distill(tiny_dir, tmp_path / "never", student=tiny_dir, stepz=1)
    assert not (tmp_path / "never").exists()
