"""Recipes and the output projection: steps compose (smooth then W8A8 is SmoothQuant), a quantized lm_head
saves and loads on its own weights, and bad recipes fail with one line and no output."""

import json

import pytest
import torch

from leanlm.compress.quant import format as qformat
from leanlm.compress.quant.smoothquant import smooth_head
from leanlm.compress.registry import apply
from leanlm.pipeline import make_config, read_recipe
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W8A8Linear, W8A16Linear
from leanlm.lowbit.record import RECORD
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model
from tests.test_cli import leanlm

SAMPLES = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))


def test_smooth_then_w8a8_is_smoothquant(tmp_path):
    make_hf_model("llama", tmp_path)
    tokens = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12)[None].expand(2, -1)
    logits = []
    for configs in ([make_config("smoothquant", {"alpha": 0.6})],
                    [make_config("smooth", {"alpha": 0.6}), make_config("rtn", {"bits": 8, "act_bits": 8})]):
        model = load_model(tmp_path, torch.float32)
        records = {}
        for config in configs:
            records |= apply(model, config, samples=SAMPLES)
        assert all(r["scheme"] == "w8a8" for r in records.values()) and len(records) == 4 * model.config.num_layers
        logits.append(model(tokens, positions))
    assert torch.equal(*logits)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied and untied embeddings
def test_quantized_lm_head_saves_and_loads(tmp_path, arch):
    make_hf_model(arch, tmp_path / "src")
    model = load_model(tmp_path / "src", torch.bfloat16)
    configs = [make_config("rtn", {"bits": 4, "group_size": 32}), make_config("lm_head", {"bits": 8})]
    records = {}
    for config in configs:
        records |= apply(model, config)
    assert isinstance(model.lm_head, W8A16Linear) and records["lm_head"]["scheme"] == "w8a16"
    (tmp_path / "q").mkdir()
    qformat.save(model, records, configs, tmp_path / "src", tmp_path / "q")
    again = load_model(tmp_path / "q", torch.bfloat16)
    tokens = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model(tokens, torch.arange(9)[None]), again(tokens, torch.arange(9)[None]))
    assert again.embed_tokens.weight.dtype == torch.bfloat16  # the embedding keeps its own 16-bit table
    recipe = json.loads((tmp_path / "q" / RECORD).read_text())["recipe"]
    assert [step["method"] for step in recipe] == ["rtn", "lm_head"]
    with pytest.raises(LeanLMError, match="already quantized"):
        apply(again, configs[1])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied and untied embeddings
def test_w8a8_lm_head_smooths_its_input_exactly_then_saves_and_loads(tmp_path, arch):
    make_hf_model(arch, tmp_path / "src")
    model = load_model(tmp_path / "src", torch.float32)
    embedding = model.embed_tokens.weight.detach().clone()
    tokens = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    before = model(tokens, torch.arange(9)[None])
    smooth_head(model, SAMPLES)
    assert not model.lm_head_is_embedding and torch.equal(model.embed_tokens.weight, embedding)
    torch.testing.assert_close(model(tokens, torch.arange(9)[None]), before, rtol=1e-4, atol=1e-4)

    model = load_model(tmp_path / "src", torch.bfloat16)
    configs = [make_config("smoothquant", {}), make_config("lm_head", {"bits": 8, "act_bits": 8})]
    records = {}
    for config in configs:
        records |= apply(model, config, samples=SAMPLES)
    assert isinstance(model.lm_head, W8A8Linear) and records["lm_head"]["scheme"] == "w8a8"
    (tmp_path / "q").mkdir()
    qformat.save(model, records, configs, tmp_path / "src", tmp_path / "q")
    again = load_model(tmp_path / "q", torch.bfloat16)
    assert torch.equal(model(tokens, torch.arange(9)[None]), again(tokens, torch.arange(9)[None]))
    with pytest.raises(LeanLMError, match="calibration"):
        apply(load_model(tmp_path / "src", torch.bfloat16), configs[1])
    with pytest.raises(LeanLMError, match="act_bits 8 \\(with bits 8"):
        make_config("lm_head", {"bits": 4, "act_bits": 8})


def test_recipe_file_through_the_cli(tiny_dir, tmp_path):
    recipe = tmp_path / "sq.yaml"
    recipe.write_text("# SmoothQuant as two steps\n- method: smooth\n  alpha: 0.5\n- {method: rtn, bits: 8, act_bits: 8}\n")
    assert [c.name for c in read_recipe(recipe)] == ["smooth", "rtn"]
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "sq"
    r = leanlm("quantize", tiny_dir, "--recipe", recipe, "--data", text, "--samples", "4", "--seq-len", "16",
               "--lm-head", "8", "-o", out)
    assert r.returncode == 0, r.stderr
    model = load_model(out, torch.bfloat16)
    assert isinstance(model.layers[0].mlp.down_proj, W8A8Linear) and isinstance(model.lm_head, W8A16Linear)
    r = leanlm("generate", out, "hello", "--max-tokens", "4", "--threads", "1")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("text,message", [
    ("- method: nope\n", "unknown method"),
    ("- method: rtn\n  alpha: 1\n", "rtn has no option alpha"),
    ("method: rtn\n", "non-empty YAML list"),
    ("- method: [rtn\n", "not valid YAML"),
    ("- method: rtn\n  bits: 3\n", "--bits 4 or 8"),
])
def test_bad_recipes(tiny_dir, tmp_path, text, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    r = leanlm("quantize", tiny_dir, "--recipe", recipe, "-o", tmp_path / "never")
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "never").exists()


def test_recipe_excludes_other_method_options(tiny_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("- method: rtn\n")
    r = leanlm("quantize", tiny_dir, "--recipe", recipe, "--bits", "4", "-o", tmp_path / "never")
    assert r.returncode == 2 and "drop --bits" in r.stderr


def test_every_method_says_what_it_does_and_optimize_reads_it():
    from leanlm.compress.registry import KINDS, METHODS
    from leanlm.optimize.variants import Variant
    from leanlm.pipeline import method

    assert method("rtn") is METHODS["rtn"]  # leanlm.pipeline imports every method's module
    kinds = {name: cls.kind for name, cls in METHODS.items()}
    assert set(kinds.values()) == set(KINDS) and len(kinds) >= 16
    assert {n for n, k in kinds.items() if k == "prune"} == {"magnitude", "wanda", "sparsegpt", "taylor", "heads",
                                                              "neurons", "layers"}
    assert Variant("p", steps=({"method": "wanda"}, {"method": "rtn"})).prunes
    assert not Variant("q", steps=({"method": "smooth"}, {"method": "rtn"})).prunes
