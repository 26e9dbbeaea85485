"""The recipe pipeline as a library: `leanlm.quantize(...)` and `leanlm.prune(...)` write what the CLI verbs write
(file for file, tensor for tensor), hand back the model as saved, report progress per step, and refuse bad input
with one clear error and no directory."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import leanlm
from leanlm.errors import LeanLMError
from leanlm.lowbit.record import RECORD
from leanlm.models.loading import load_model
from tests.test_cli import leanlm as run_cli


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. hello world, hello there. " * 30)
    return path


def _same_directories(a, b):
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for name in ("config.json", "quantization.json", "pruning.json"):
        if (a / name).exists():
            assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), name
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys()
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key


def test_quantize_writes_what_the_cli_writes(tiny_dir, text, tmp_path):
    calib = dict(data=text, samples=4, seq_len=16)
    steps = []
    built = leanlm.quantize(tiny_dir, method="gptq", bits=4, group_size=32, out=tmp_path / "lib", **calib,
                            progress=lambda name, ticks: steps.append((name, ticks)) or (lambda layer: None))
    r = run_cli("quantize", tiny_dir, "--method", "gptq", "--bits", "4", "--group-size", "32", "--data", text,
                "--samples", "4", "--seq-len", "16", "-o", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    _same_directories(tmp_path / "lib", tmp_path / "cli")
    assert [c.name for c in built.steps] == ["gptq", "lm_head"] and built.quantized  # 4-bit weights: an int8 head
    assert [name for name, _ in steps] == ["gptq", "lm_head"] and steps[1][1] == 1
    ids, positions = torch.tensor([[1, 5, 9, 3]]), torch.arange(4)[None]
    saved = load_model(tmp_path / "lib", built.model.dtype)
    assert torch.equal(built.model(ids, positions), saved(ids, positions))  # the model handed back is the one saved


def test_symmetric_hqq_from_the_cli(tiny_dir, tmp_path):
    leanlm.quantize(tiny_dir, method="hqq", group_size=32, symmetric=True, out=tmp_path / "lib")
    r = run_cli("quantize", tiny_dir, "--method", "hqq", "--group-size", "32", "--symmetric", "-o", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    _same_directories(tmp_path / "lib", tmp_path / "cli")
    recipe = json.loads((tmp_path / "cli" / RECORD).read_text())["recipe"]
    assert recipe[0] == {"method": "hqq", "bits": 4, "group_size": 32, "symmetric": True, "act_bits": 16, "iters": 20,
                         "lp_norm": 0.7, "beta": 10.0, "kappa": 1.01}


def test_prune_writes_what_the_cli_writes(tiny_dir, text, tmp_path):
    leanlm.prune(tiny_dir, method="wanda", sparsity=0.5, out=tmp_path / "lib", data=text, samples=4, seq_len=16)
    r = run_cli("prune", tiny_dir, "--method", "wanda", "--sparsity", "0.5", "--data", text, "--samples", "4",
                "--seq-len", "16", "-o", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    _same_directories(tmp_path / "lib", tmp_path / "cli")
    assert json.loads((tmp_path / "lib" / "pruning.json").read_text())["recipe"][0]["method"] == "wanda"


def test_a_recipe_as_a_list_of_steps(tiny_dir, tmp_path):
    built = leanlm.prune(tiny_dir, recipe=[{"method": "magnitude", "pattern": "2:4"}, {"method": "rtn", "bits": 8}],
                         out=tmp_path / "q")
    assert built.quantized and json.loads((tmp_path / "q" / "quantization.json").read_text())["recipe"] == [
        {"method": "magnitude", "sparsity": None, "pattern": "2:4", "scope": "row"}, {"method": "rtn", "bits": 8,
                                                                                     "group_size": 128, "act_bits": 16,
                                                                                     "layers": None, "symmetric": False}]


@pytest.mark.parametrize("call,message", [
    (lambda d, o: leanlm.quantize(d, method="rtn", recipe=[{"method": "rtn"}], bits=4, out=o), "drop bits, method"),
    (lambda d, o: leanlm.quantize(d, method="nope", out=o), "unknown method 'nope'"),
    (lambda d, o: leanlm.prune(d, out=o), "prune needs a method"),
    (lambda d, o: leanlm.prune(d, method="wanda", bits=8, out=o), "wanda has no option bits"),
    (lambda d, o: leanlm.quantize(d, samples=0, out=o), "samples must be at least 1"),
])
def test_bad_input_is_one_clear_error_and_no_directory(tiny_dir, tmp_path, call, message):
    with pytest.raises(LeanLMError, match=message):
        call(tiny_dir, tmp_path / "never")
    assert not (tmp_path / "never").exists() and not list(tmp_path.glob(".never*"))


def test_an_existing_output_or_a_quantized_source_is_refused(tiny_dir, tmp_path):
    built = leanlm.quantize(tiny_dir, bits=8, out=tmp_path / "q")
    with pytest.raises(LeanLMError, match="already exists"):
        leanlm.quantize(tiny_dir, bits=8, out=built.path)
    with pytest.raises(LeanLMError, match="already quantized"):
        leanlm.quantize(built.path, bits=8, out=tmp_path / "again")
