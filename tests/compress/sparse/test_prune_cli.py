"""`leanlm prune` as a user runs it: the directory it writes loads in leanlm (and its verbs) with the sparsity
asked per layer; a recipe prunes then quantizes keeping the zeros; a smaller model is an ordinary HF directory;
bad input is one clear line and leaves no directory."""

from __future__ import annotations

import json

import pytest
import torch

from leanlm.compress.registry import decoder_linears
from leanlm.compress.sparse.masks import module_sparsity
from leanlm.compress.sparse.save import RECORD as PRUNING_RECORD
from leanlm.lowbit.linear import W4A16Linear, W8A16Linear, W8A16Sparse24Linear
from leanlm.lowbit.record import RECORD as QUANT_RECORD
from leanlm.models.loading import load_model
from tests.test_cli import leanlm


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. hello world, hello there. " * 30)
    return path


def _prune(tiny_dir, text, out, *args):
    return leanlm("prune", tiny_dir, *args, "--data", text, "--samples", "4", "--seq-len", "16", "-o", out)


def test_sparsegpt_2_4_loads_runs_and_shows_its_sparsity(tiny_dir, text, tmp_path):
    out = tmp_path / "sparse"
    r = _prune(tiny_dir, text, out, "--method", "sparsegpt", "--pattern", "2:4")
    assert r.returncode == 0, r.stderr
    assert "50.0% of the decoder projections' weights are zero (2:4)" in r.stdout
    model = load_model(out, torch.float32)
    for _, linear in decoder_linears(model):
        assert ((linear.weight == 0).reshape(linear.out_features, -1, 4).sum(-1) >= 2).all()
    record = json.loads((out / PRUNING_RECORD).read_text())
    assert record["recipe"][0]["method"] == "sparsegpt" and record["recipe"][0]["pattern"] == "2:4"
    assert {r["pattern"] for r in record["layers"].values()} == {"2:4"}
    r = leanlm("info", out, "--dtype", "float32")
    assert r.returncode == 0 and "sparsity" in r.stdout and "50.0%, 2:4" in r.stdout, r.stdout
    assert "weights on disk MB" in r.stdout
    r = leanlm("generate", out, "hello", "--max-tokens", "4", "--threads", "1")
    assert r.returncode == 0, r.stderr


def test_wanda_sparsity_per_row(tiny_dir, text, tmp_path):
    out = tmp_path / "wanda"
    r = _prune(tiny_dir, text, out, "--method", "wanda", "--sparsity", "0.3", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    for _, linear in decoder_linears(load_model(out, torch.float32)):
        assert ((linear.weight == 0).sum(1) == round(0.3 * linear.in_features)).all()


def test_recipe_sparsegpt_then_gptq_keeps_the_mask(tiny_dir, text, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text('- {method: sparsegpt, sparsity: 0.5, pattern: "2:4"}\n'
                      '- {method: gptq, bits: 4, group_size: 32}\n')
    out = tmp_path / "sq"
    r = _prune(tiny_dir, text, out, "--recipe", recipe)
    assert r.returncode == 0, r.stderr
    model = load_model(out, torch.bfloat16)
    layers = json.loads((out / QUANT_RECORD).read_text())["layers"]
    for name, rec in layers.items():
        module = model.get_submodule(name)
        assert isinstance(module, W4A16Linear) and rec["scheme"] == "w4a16" and rec["pattern"] == "2:4"
        assert module_sparsity(module) >= 0.5
    r = leanlm("generate", out, "hello", "--max-tokens", "4", "--threads", "1")
    assert r.returncode == 0, r.stderr


def test_prune_then_quantize_is_the_recipe_in_one_run(tiny_dir, text, tmp_path):
    """`leanlm prune` then `leanlm quantize` gives the recipe's model and record, and every verb takes it."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text('- {method: sparsegpt, sparsity: 0.5, pattern: "2:4"}\n'
                      '- {method: gptq, bits: 4, group_size: 32}\n')
    assert _prune(tiny_dir, text, tmp_path / "one", "--recipe", recipe).returncode == 0
    r = _prune(tiny_dir, text, tmp_path / "pruned", "--method", "sparsegpt", "--sparsity", "0.5", "--pattern", "2:4")
    assert r.returncode == 0, r.stderr
    two = tmp_path / "two"
    r = leanlm("quantize", tmp_path / "pruned", "--method", "gptq", "--bits", "4", "--group-size", "32", "--data", text,
               "--samples", "4", "--seq-len", "16", "--lm-head", "16", "-o", two)  # the recipe keeps a 16-bit head
    assert r.returncode == 0 and "8 layers quantized" in r.stdout, r.stderr
    one_record, two_record = (json.loads((tmp_path / d / QUANT_RECORD).read_text()) for d in ("one", "two"))
    assert [s["method"] for s in two_record["recipe"]] == ["sparsegpt", "gptq"]
    assert two_record["recipe"] == one_record["recipe"] and two_record["layers"] == one_record["layers"]
    assert {(r["scheme"], r["pattern"]) for r in two_record["layers"].values()} == {("w4a16", "2:4")}
    one, loaded = load_model(tmp_path / "one", torch.bfloat16), load_model(two, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(one.state_dict().values(), loaded.state_dict().values()))
    for verb, *args in [("generate", "hello", "--max-tokens", "4"),
                        ("eval", "--data", text, "--window", "64", "--stride", "32"),
                        ("bench", "--prompt-tokens", "8", "--new-tokens", "4", "--eager")]:
        r = leanlm(verb, two, *args, "--threads", "1")
        assert r.returncode == 0, r.stderr
    r = leanlm("info", two)  # the pruning as recorded: the int4 codes cannot tell it
    assert r.returncode == 0 and "sparsity" in r.stdout and "50.0%, 2:4" in r.stdout, r.stdout


def test_sparsegpt_joint_int8(tiny_dir, text, tmp_path):
    out = tmp_path / "w8"
    r = _prune(tiny_dir, text, out, "--method", "sparsegpt", "--sparsity", "0.5", "--bits", "8")
    assert r.returncode == 0, r.stderr
    down = load_model(out, torch.bfloat16).layers[0].mlp.down_proj
    assert isinstance(down, W8A16Linear) and ((down.weight == 0).sum(1) >= 48).all()  # K = 96


def test_sparsegpt_2_4_int8_is_stored_compactly(tiny_dir, text, tmp_path):
    """2:4 + int8 is saved as W8A16Sparse24Linear (5 bits a weight), with the logits of --no-compact's W8A16Linear."""
    args = ("--method", "sparsegpt", "--pattern", "2:4", "--bits", "8")
    runs = {flag: _prune(tiny_dir, text, tmp_path / flag, *args, f"--{flag}") for flag in ("compact", "no-compact")}
    assert all(r.returncode == 0 for r in runs.values()), [r.stderr for r in runs.values()]
    compact, dense = (load_model(tmp_path / flag, torch.bfloat16) for flag in runs)
    layers = json.loads((tmp_path / "compact" / QUANT_RECORD).read_text())["layers"]
    for name, rec in layers.items():
        module = compact.get_submodule(name)
        assert isinstance(module, W8A16Sparse24Linear) and rec["scheme"] == "w8a16_2:4" and rec["pattern"] == "2:4"
        assert torch.equal(module.codes(), dense.get_submodule(name).weight)
    assert isinstance(dense.layers[0].mlp.down_proj, W8A16Linear)
    tokens = torch.tensor([[1, 5, 9, 2]])
    assert torch.equal(compact(tokens, torch.arange(4)[None], None), dense(tokens, torch.arange(4)[None], None))
    r = leanlm("info", tmp_path / "compact")
    assert r.returncode == 0 and "50.0%" in r.stdout, r.stderr


def test_prune_then_quantize_w8_stores_2_4_as_the_recipe_does(tiny_dir, text, tmp_path):
    """--compact means the same in both verbs: sparsegpt 2:4 then `quantize --bits 8 --compact` writes the one-run
    recipe's compact model and record; without --compact both write dense W8."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text('- {method: sparsegpt, sparsity: 0.5, pattern: "2:4"}\n- {method: rtn, bits: 8}\n')
    assert _prune(tiny_dir, text, tmp_path / "one", "--recipe", recipe, "--compact").returncode == 0
    r = _prune(tiny_dir, text, tmp_path / "pruned", "--method", "sparsegpt", "--sparsity", "0.5", "--pattern", "2:4")
    assert r.returncode == 0, r.stderr
    quantize = ("quantize", tmp_path / "pruned", "--method", "rtn", "--bits", "8")
    r = leanlm(*quantize, "--compact", "-o", tmp_path / "two")
    assert r.returncode == 0 and "8 of them stored 2:4-compact" in r.stdout, r.stderr
    one, two = (json.loads((tmp_path / d / QUANT_RECORD).read_text()) for d in ("one", "two"))
    assert two["recipe"] == one["recipe"] and two["layers"] == one["layers"]
    assert {r["scheme"] for r in two["layers"].values()} == {"w8a16_2:4"}
    a, b = load_model(tmp_path / "one", torch.bfloat16), load_model(tmp_path / "two", torch.bfloat16)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert isinstance(b.layers[0].mlp.down_proj, W8A16Sparse24Linear)
    r = leanlm(*quantize, "-o", tmp_path / "dense")
    assert r.returncode == 0 and "compact" not in r.stdout, r.stderr
    assert type(load_model(tmp_path / "dense", torch.bfloat16).layers[0].mlp.down_proj) is W8A16Linear


def test_a_smaller_model_is_an_hf_directory(tiny_dir, text, tmp_path):
    out = tmp_path / "short"
    r = _prune(tiny_dir, text, out, "--method", "layers", "--num-layers", "1")
    assert r.returncode == 0, r.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and (out / "tokenizer.json").exists()
    assert load_model(out, torch.float32).config.num_layers == 1
    layers = json.loads((out / "pruning.json").read_text())["layers"]  # named by the saved model's layers
    assert [name for name in layers if name != "model"] == ["layers.0"] and layers["layers.0"]["original_layer"] in (0, 1)
    assert [r["original_layer"] for r in layers["model"]["removed"]] == [1 - layers["layers.0"]["original_layer"]]


@pytest.mark.parametrize("args,message", [
    (["--method", "wanda", "--sparsity", "1.5"], "in [0, 1)"),
    (["--method", "sparsegpt", "--pattern", "3:5"], "divisible by 5"),
    (["--method", "magnitude", "--pattern", "2-4"], "not N:M"),
    (["--method", "nope"], "unknown method 'nope'"),
    (["--method", "wanda", "--bits", "8"], "wanda has no option bits"),
    (["--method", "sparsegpt", "--pattern", "2:4", "--sparsity", "0.7"], "prunes 0.5 of the weights"),
    ([], "give --method"),
])
def test_bad_input_is_one_clear_line_and_no_directory(tiny_dir, text, tmp_path, args, message):
    out = tmp_path / "never"
    r = _prune(tiny_dir, text, out, *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists() and not list(tmp_path.glob(".never*"))


@pytest.mark.parametrize("verb,method", [("prune", "wanda"), ("quantize", "gptq")])
def test_calibration_without_text_is_one_clear_line_and_no_directory(tiny_dir, tmp_path, verb, method):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = leanlm(verb, tiny_dir, "--method", method, "--data", empty, "-o", tmp_path / "never")
    assert r.returncode == 2 and "contains no text" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "never").exists() and not list(tmp_path.glob(".never*"))


def test_calibration_windows_longer_than_the_context_are_cut_to_it(tiny_dir, text, tmp_path):
    out = tmp_path / "long"  # the tiny model's context is 256 tokens
    r = leanlm("prune", tiny_dir, "--method", "wanda", "--data", text, "--samples", "2", "--seq-len", "300", "-o", out)
    assert r.returncode == 0 and "windows of 256 tokens" in r.stderr, r.stderr
