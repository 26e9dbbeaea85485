import json

import pytest
import torch

from leanlm.compress.quant import format as qformat
from leanlm.compress.quant.hqq import HQQ
from leanlm.compress.quant.rtn import FP8, RTN
from leanlm.compress.registry import apply, decoder_linears
from leanlm.errors import LeanLMError
from leanlm.lowbit.record import RECORD, VERSION
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model
from tests.test_cli import leanlm


@pytest.mark.parametrize("config,bits", [(RTN(8), 8), (RTN(4, 32), 4), (RTN(8, act_bits=8), 8), (FP8(), 8),
                                         (RTN(4, 32, symmetric=True), 4), (HQQ(group_size=32), 4),
                                         (RTN(4, 32, act_bits=8), 4), (HQQ(group_size=32, act_bits=8), 4)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantize_save_load_gives_identical_logits(tmp_path, config, bits, arch):
    make_hf_model(arch, tmp_path / "src")
    model = load_model(tmp_path / "src", torch.bfloat16)
    float_bytes = {n: m.weight.numel() for n, m in decoder_linears(model)}
    records = apply(model, config)
    assert set(records) == set(float_bytes)
    out = tmp_path / "q"
    out.mkdir()
    qformat.save(model, records, config, tmp_path / "src", out)
    again = load_model(out, torch.bfloat16)
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(11)[None].expand(2, -1)
    assert torch.equal(model(tokens, positions), again(tokens, positions))
    for name, numel in float_bytes.items():  # resident bytes follow the bits per weight (scales included)
        module = again.get_submodule(name)
        stored = sum(b.nbytes for n, b in module.named_buffers() if n != "bias")
        assert numel * bits / 8 <= stored <= 1.1 * numel * bits / 8 + 8 * module.out_features


def test_quantized_output_stays_close_to_float(tmp_path):
    make_hf_model("llama", tmp_path)
    ref = load_model(tmp_path, torch.bfloat16)
    tokens = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16)[None]
    expected = ref(tokens, positions).float()
    errors = {}
    for config in (RTN(8), RTN(4, 32)):
        model = load_model(tmp_path, torch.bfloat16)
        apply(model, config)
        errors[config.bits] = ((model(tokens, positions).float() - expected).norm() / expected.norm()).item()
    assert errors[8] < 0.02 and errors[8] < errors[4] < 0.3


@pytest.mark.parametrize("kwargs", [dict(bits=5), dict(bits=4, act_bits=4), dict(bits=4, group_size=48),
                                    dict(act_bits=4), dict(layers={"x": 5}), dict(layers=["x"]), dict(layers={1: 8}),
                                    dict(layers={"x": {"bits": 4, "group_size": 48}}),
                                    dict(layers={"x": {"bits": 8, "group_size": 32}}), dict(layers={"x": {"b": 4}})])
def test_bad_options(kwargs):
    with pytest.raises(LeanLMError):
        RTN(**kwargs)


def test_cli_quantize_then_generate(tiny_dir, tmp_path):
    out = tmp_path / "w4"
    r = leanlm("quantize", tiny_dir, "--bits", "4", "--group-size", "32", "-o", out)
    assert r.returncode == 0, r.stderr
    assert (out / "quantization.json").exists() and (out / "tokenizer.json").exists()
    layers = json.loads((out / "quantization.json").read_text())["layers"]
    assert layers["lm_head"]["scheme"] == "w8a16"  # 4-bit weights get an int8 head unless told --lm-head 16
    r = leanlm("generate", out, "hello", "--max-tokens", "4", "--threads", "1")
    assert r.returncode == 0, r.stderr
    for args, message in [(["--method", "nope"], "unknown method"), (["--method", "gptq", "--bits", "8"], "--bits 4"),
                          (["--bits", "3"], "--bits 4 or 8"), (["--alpha", "0.5"], "rtn has no option alpha"),
                          (["--bits", "4", "--group-size", "48"], "--group-size must be one of"),
                          (["--method", "smoothquant", "--alpha", "2"], "out of range"),
                          (["--lm-head", "5"], "8 (per-channel) or 4"), (["--samples", "0", "--method", "awq"], "samples must be at least 1")]:
        r = leanlm("quantize", tiny_dir, *args, "-o", tmp_path / "never")
        assert r.returncode == 2 and message in r.stderr and not (tmp_path / "never").exists()
    r = leanlm("quantize", tiny_dir, "-o", out)
    assert r.returncode == 2 and "already exists" in r.stderr
    r = leanlm("quantize", out, "-o", tmp_path / "twice")
    assert r.returncode == 2 and "already quantized" in r.stderr


def test_gptq_method_beats_rtn_on_a_tiny_model(tmp_path):
    from leanlm.compress.quant.gptq import GPTQ

    make_hf_model("llama", tmp_path, intermediate_size=128)
    ref = load_model(tmp_path, torch.float32)
    samples = torch.randint(3, 128, (16, 32), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(32)[None].expand(4, -1)
    expected = ref(tokens, positions).float()
    errors = {}
    for config in (RTN(4, 32), GPTQ(group_size=32)):
        model = load_model(tmp_path, torch.float32)
        records = apply(model, config, samples=samples)
        assert all(r == {"scheme": "w4a16", "group_size": 32} for r in records.values())
        errors[config.name] = (model(tokens, positions).float() - expected).norm().item()
    assert errors["gptq"] < errors["rtn"]
    with pytest.raises(LeanLMError, match="needs calibration data"):
        apply(load_model(tmp_path, torch.float32), GPTQ())


def _save_and_reload(tmp_path, model, records, config):
    out = tmp_path / "q"
    out.mkdir()
    qformat.save(model, records, config, tmp_path / "src", out)
    return out, load_model(out, torch.bfloat16)


def test_static_w8a8_round_trips_its_act_scale(tmp_path):
    from leanlm.lowbit.linear import W8A8Linear
    from leanlm.lowbit.record import replace

    make_hf_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src", torch.bfloat16)
    records = {}
    for name, linear in list(decoder_linears(model)):
        new = W8A8Linear.from_float(linear, act_scale=0.03)
        replace(model, name, new)
        records[name] = new.record()
    assert all(r["act_scale"] == pytest.approx(0.03) for r in records.values())
    _, again = _save_and_reload(tmp_path, model, records, RTN(8, act_bits=8))
    assert all(float(again.get_submodule(n).act_scale) == float(model.get_submodule(n).act_scale) for n in records)
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(11)[None].expand(2, -1)
    assert torch.equal(model(tokens, positions), again(tokens, positions))


@pytest.mark.parametrize("layer_record,message", [({"scheme": "w3a3"}, "unknown scheme 'w3a3'"),
                                                  ({"scheme": "w8a16", "group_size": 64}, "does not take")])
def test_bad_records_raise(tmp_path, layer_record, message):
    import json

    make_hf_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src", torch.bfloat16)
    out, _ = _save_and_reload(tmp_path, model, apply(model, RTN(8)), RTN(8))
    record = json.loads((out / RECORD).read_text())
    record["layers"]["layers.0.mlp.down_proj"] = layer_record
    (out / RECORD).write_text(json.dumps(record))
    with pytest.raises(LeanLMError, match=message):
        load_model(out, torch.bfloat16)


def test_other_format_version_raises(tmp_path):
    import json

    make_hf_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src", torch.bfloat16)
    out, _ = _save_and_reload(tmp_path, model, apply(model, RTN(8)), RTN(8))
    record = json.loads((out / RECORD).read_text())
    assert record["version"] == VERSION
    (out / RECORD).write_text(json.dumps(record | {"version": VERSION + 1}))
    with pytest.raises(LeanLMError, match="quantize the model again"):
        load_model(out, torch.bfloat16)


def test_4_bit_methods_default_to_an_int8_lm_head():
    from leanlm.pipeline import default_lm_head
    from leanlm.compress.quant.gptq import GPTQ
    from leanlm.pipeline import make_config

    assert default_lm_head([RTN(4, 32)]) == default_lm_head([GPTQ()]) == 8
    from leanlm.compress.quant.aqlm import AQLM

    assert default_lm_head([AQLM(bits=2)]) == 8
    assert default_lm_head([RTN(8)]) == default_lm_head([RTN(8, act_bits=8)]) == 16
    assert default_lm_head([RTN(4, 32), make_config("lm_head", {"bits": 4})]) == 16  # a recipe's own head step


def test_per_layer_bits_last_matching_pattern_wins(tmp_path):
    from leanlm.lowbit.linear import W4A16Linear, W8A16Linear
    from leanlm.models.layers import Linear

    make_hf_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src", torch.bfloat16)
    config = RTN(4, 32, layers={"layers.*.mlp.*": 8, "layers.1.mlp.down_proj": {"bits": 4, "group_size": 32},
                                "layers.0.self_attn.o_proj": 16})
    records = apply(model, config)
    kinds = {name: (type(m).__name__, getattr(m, "group_size", None)) for name, m in model.named_modules()
             if isinstance(m, (Linear, W4A16Linear, W8A16Linear)) and name.startswith("layers.")}
    w4, w8 = ("W4A16Linear", 32), ("W8A16Linear", None)
    assert kinds == {"layers.0.self_attn.qkv_proj": w4, "layers.0.self_attn.o_proj": ("Linear", None),
                     "layers.0.mlp.gate_up_proj": w8, "layers.0.mlp.down_proj": w8,
                     "layers.1.self_attn.qkv_proj": w4, "layers.1.self_attn.o_proj": w4,
                     "layers.1.mlp.gate_up_proj": w8, "layers.1.mlp.down_proj": w4}
    assert "layers.0.self_attn.o_proj" not in records and len(records) == 7
    with pytest.raises(LeanLMError, match="'layers.9.\\*' match no decoder projection"):
        apply(load_model(tmp_path / "src", torch.bfloat16), RTN(4, 32, layers={"layers.9.*": 8}))


def test_mixed_gptq_through_a_recipe(tiny_dir, tmp_path):
    """rtn leaves all but the named projections in float (16); gptq then takes the rest."""
    from leanlm.lowbit.linear import W4A16Linear, W8A16Linear

    recipe = tmp_path / "mixed.yaml"
    recipe.write_text("- method: rtn\n  bits: 8\n  layers:\n    '*': 16\n    layers.*.mlp.down_proj: 8\n"
                      "- {method: gptq, group_size: 32}\n")
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "mixed"
    r = leanlm("quantize", tiny_dir, "--recipe", recipe, "--data", text, "--samples", "4", "--seq-len", "16",
               "--lm-head", "16", "-o", out)
    assert r.returncode == 0, r.stderr
    model = load_model(out, torch.bfloat16)
    for i in range(2):
        assert isinstance(model.get_submodule(f"layers.{i}.mlp.down_proj"), W8A16Linear)
        assert isinstance(model.get_submodule(f"layers.{i}.mlp.gate_up_proj"), W4A16Linear)
    recipe_saved = json.loads((out / "quantization.json").read_text())["recipe"]
    assert recipe_saved[0]["layers"] == {"*": 16, "layers.*.mlp.down_proj": 8} and recipe_saved[1]["method"] == "gptq"
