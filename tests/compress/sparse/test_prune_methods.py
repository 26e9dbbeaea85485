"""The pruning methods on a tiny model through the registry: each layer ends at the sparsity asked; masks survive
a later GPTQ/RTN step and joint SparseGPT + int8 (the W8A16 runtime modules hold the zeros); Taylor saliency is
|w * dL/dw|; a pruned float model saves as an HF directory that leanlm and transformers load alike."""

from __future__ import annotations

import json

import pytest
import torch

from leanlm.compress.quant import format as qformat
from leanlm.compress.registry import apply, decoder_linears
from leanlm.pipeline import make_config
from leanlm.compress.sparse.save import RECORD, save_float
from leanlm.compress.sparse.taylor import taylor_saliency
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W4A16Linear, W8A16Linear, unpack_int4
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model, make_tokenizer

SAMPLES = torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(0))
TOKENS = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("src")
    make_hf_model("llama", path)
    make_tokenizer(path)
    return path


def _logits(model):
    return model(TOKENS, torch.arange(TOKENS.shape[1])[None])


def _nm_ok(pruned: torch.Tensor, n: int, m: int) -> bool:
    return bool((pruned.reshape(pruned.shape[0], -1, m).sum(-1) >= m - n).all())


@pytest.mark.parametrize("method,options", [
    ("magnitude", {"sparsity": 0.6}), ("magnitude", {"sparsity": 0.5, "scope": "layer"}),
    ("wanda", {"sparsity": 0.5}), ("sparsegpt", {"sparsity": 0.5}), ("taylor", {"sparsity": 0.4}),
    ("magnitude", {"pattern": "2:4"}), ("wanda", {"pattern": "4:8"}), ("sparsegpt", {"pattern": "2:4"}),
    ("taylor", {"pattern": "2:4", "sparsity": 0.5})])
def test_every_layer_ends_at_the_sparsity_asked(src, method, options):
    model = load_model(src, torch.float32)
    records = apply(model, make_config(method, options), samples=SAMPLES)
    assert len(records) == 4 * model.config.num_layers
    pattern = options.get("pattern")
    for name, linear in decoder_linears(model):
        zeros = linear.weight == 0
        assert records[name]["pattern"] == (pattern or "unstructured")
        assert records[name]["sparsity"] == pytest.approx(zeros.float().mean().item())
        if pattern:
            assert _nm_ok(zeros, *map(int, pattern.split(":")))
        elif options.get("scope") == "layer":
            assert zeros.sum() == round(options["sparsity"] * zeros.numel())
        else:
            assert (zeros.sum(1) == round(options["sparsity"] * linear.in_features)).all()
    assert torch.isfinite(_logits(model)).all()


def test_wanda_with_owl_moves_block_sparsities_around_the_target(src):
    model = load_model(src, torch.float32)
    records = apply(model, make_config("wanda", {"sparsity": 0.5, "owl": 0.1}), samples=SAMPLES)
    blocks = [sum(r["sparsity"] for n, r in records.items() if n.startswith(f"layers.{i}.")) / 4 for i in range(2)]
    assert blocks[0] != pytest.approx(blocks[1], abs=0.05)
    assert all(0.39 <= s <= 0.61 for s in blocks)


def test_taylor_saliency_is_weight_times_gradient(src):
    model = load_model(src, torch.float32)
    batch = SAMPLES[:2]
    scores = taylor_saliency(model, batch, batch_size=2)
    weight = model.layers[1].mlp.down_proj.weight
    weight.requires_grad_(True)
    logits = model(batch, torch.arange(16)[None].expand(2, -1))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
    (grad,) = torch.autograd.grad(loss, weight)
    weight.requires_grad_(False)
    torch.testing.assert_close(scores["layers.1.mlp.down_proj"], (weight * grad).abs())
    assert not any(p.requires_grad for p in model.parameters())  # left as it was


def test_joint_sparsegpt_int8_lands_on_w8a16_and_saves(src, tmp_path):
    model = load_model(src, torch.float32)
    config = make_config("sparsegpt", {"pattern": "2:4", "bits": 8})
    records = apply(model, config, samples=SAMPLES)
    for name, _ in records.items():
        module = model.get_submodule(name)
        assert isinstance(module, W8A16Linear) and _nm_ok(module.weight == 0, 2, 4)
        assert records[name]["scheme"] == "w8a16" and records[name]["pattern"] == "2:4"
    qformat.save(model, records, config, src, tmp_path)
    again = load_model(tmp_path, torch.float32)
    assert torch.equal(_logits(model), _logits(again))
    assert torch.equal(again.layers[0].mlp.down_proj.weight, model.layers[0].mlp.down_proj.weight)


@pytest.mark.parametrize("then", [{"method": "gptq", "bits": 4, "group_size": 32},
                                  {"method": "rtn", "bits": 4, "group_size": 32}, {"method": "rtn", "bits": 8},
                                  {"method": "awq", "bits": 4, "group_size": 32}, {"method": "smoothquant"},
                                  {"method": "llm_int8"}, {"method": "fp8"}], ids=lambda then: then["method"])
def test_a_quantization_step_after_sparsegpt_keeps_the_zeros(src, then):
    model = load_model(src, torch.float32)
    apply(model, make_config("sparsegpt", {"sparsity": 0.5, "pattern": "2:4"}), samples=SAMPLES)
    pruned = {name: m.weight == 0 for name, m in decoder_linears(model)}
    apply(model, make_config(then["method"], {k: v for k, v in then.items() if k != "method"}), samples=SAMPLES)
    for name, mask in pruned.items():
        module = model.get_submodule(name)
        if not isinstance(module, W4A16Linear):  # int8 (W8A16, W8A8, LLM.int8()) or fp8 weights: exact zeros
            assert (module.weight[mask] == 0).all()
            continue
        assert isinstance(module, W4A16Linear)
        # The code of a pruned weight is its group's zero point; the kernel's bf16 zero term leaves it within
        # bf16 rounding of 0 (w = (q - 8) s + bf16((8 - z) s)), far below one grid step s.
        g = module.group_size
        scales = module.scales.float().t().repeat_interleave(g, 1)
        zero_code = (8 - module.zeros.float().t().repeat_interleave(g, 1) / scales).round()
        assert (unpack_int4(module.weight_packed).float()[mask] == zero_code[mask]).all()
        assert (module.dequantized_weight().abs()[mask] <= scales[mask] / 32).all()


def test_pruned_float_model_saves_as_an_hf_directory(src, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = load_model(src, torch.float32)
    records = apply(model, make_config("wanda", {"sparsity": 0.5}), samples=SAMPLES)
    save_float(model, src, tmp_path, {"recipe": [{"method": "wanda"}], "layers": records})
    assert (tmp_path / "tokenizer.json").exists() and json.loads((tmp_path / RECORD).read_text())["layers"] == records
    again = load_model(tmp_path, torch.float32)
    assert torch.equal(_logits(model), _logits(again))
    assert (again.layers[1].self_attn.qkv_proj.weight == 0).float().mean() == 0.5
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, _logits(model), atol=1e-4, rtol=1e-4)
    quantized = load_model(src, torch.float32)
    apply(quantized, make_config("rtn", {"bits": 8}))
    with pytest.raises(LeanLMError, match="quantized layers"):
        save_float(quantized, src, tmp_path)


def test_method_errors(src):
    model = load_model(src, torch.float32)
    with pytest.raises(LeanLMError, match="divisible by 3"):
        apply(model, make_config("wanda", {"pattern": "1:3"}), samples=SAMPLES)
    with pytest.raises(LeanLMError, match="needs calibration data"):
        apply(model, make_config("sparsegpt", {}))
    with pytest.raises(LeanLMError, match="--bits 8 or 4"):
        make_config("sparsegpt", {"bits": 3})
    with pytest.raises(LeanLMError, match="OWL"):
        make_config("wanda", {"pattern": "2:4", "owl": 0.08})
    assert all(not (m.weight == 0).any() for _, m in decoder_linears(model))  # nothing was touched
