import json

import pytest
import torch
from safetensors.torch import load_file

from leanlm.compress.quant.export import export, pack_int32
from leanlm.compress.quant.llm_int8 import LLMInt8
from leanlm.compress.quant.rtn import FP8, RTN, Head
from leanlm.compress.registry import apply
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W8A8Linear
from leanlm.models.loading import load_model, to_hf_names
from tests.conftest import make_hf_model
from tests.test_cli import leanlm

compressed_tensors = pytest.importorskip("compressed_tensors")


def _load_with_transformers(path):
    """The exported directory through transformers' compressed-tensors loader, decompressed to float weights.
    (Its compressed path allocates asymmetric zero points unpacked, [N, K/g], not the packed [N/8, K/g] that
    compressed-tensors itself writes and reads, and gave wrong logits for int-quantized W8A8 in transformers
    5.23 with compressed-tensors 0.20; the decompressing path reads both right.)"""
    import transformers

    config = transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_int32_matches_compressed_tensors(bits):
    codes = torch.randint(0, 2**bits, (6, 64), generator=torch.Generator().manual_seed(bits))
    signed = (codes - 2 ** (bits - 1)).to(torch.int8)  # compressed-tensors packs signed codes with an offset
    expected = compressed_tensors.compressors.pack_quantized.helpers.pack_to_int32(signed, bits)
    assert torch.equal(pack_int32(codes, bits), expected)


@pytest.mark.parametrize("configs", [[RTN(4, 32)], [RTN(8)], [RTN(8, act_bits=8)], [FP8()], [RTN(4, 32), Head(4, 32)]],
                         ids=["w4a16", "w8a16", "w8a8", "fp8", "w4+head"])
def test_transformers_loads_the_same_model(tmp_path, configs):
    make_hf_model("qwen2", tmp_path / "src")  # q/k/v biases and tied embeddings: both need care when split
    model = load_model(tmp_path / "src", torch.float32)
    for config in configs:
        apply(model, config)
    (tmp_path / "out").mkdir()
    export(model, tmp_path / "src", tmp_path / "out")
    hf = _load_with_transformers(tmp_path / "out")
    ours = {n: m.dequantized_weight() for n, m in model.named_modules() if hasattr(m, "dequantized_weight")}
    ours = to_hf_names({f"{n}.weight": w for n, w in ours.items()}, model.config)
    theirs = hf.state_dict()
    assert ours.keys() <= theirs.keys()
    for name, w in ours.items():  # w4: our zero point is the bf16 weight at code 8, theirs an integer code
        torch.testing.assert_close(theirs[name].float(), w, rtol=2**-8, atol=0.01 * w.abs().max().item())
    tokens = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = model(tokens, torch.arange(12)[None])  # w8a8: ours quantizes activations, the decompressed not
    got = hf(tokens).logits
    assert ((got - expected).norm() / expected.norm()).item() < 0.01


@pytest.mark.parametrize("act_scale", [None, 0.02])
def test_w8a8_activation_scheme(tmp_path, act_scale):
    make_hf_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src", torch.bfloat16)
    apply(model, RTN(8, act_bits=8))
    for m in model.modules():
        if isinstance(m, W8A8Linear):
            m.act_scale = None if act_scale is None else torch.tensor(act_scale)
    (tmp_path / "out").mkdir()
    (group,) = export(model, tmp_path / "src", tmp_path / "out")["config_groups"].values()
    acts = group["input_activations"]
    assert group["format"] == "int-quantized" and acts["num_bits"] == 8 and acts["symmetric"]
    assert (acts["strategy"], acts["dynamic"]) == (("token", True) if act_scale is None else ("tensor", False))
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    scales = [t for k, t in tensors.items() if k.endswith("input_scale")]
    assert len(scales) == (0 if act_scale is None else 14) and all(t.item() == pytest.approx(act_scale) for t in scales)
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8


def test_w4a8_is_int4_groups_with_dynamic_int8_activations(tmp_path):
    make_hf_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src", torch.bfloat16)
    apply(model, RTN(4, 32, act_bits=8))
    (tmp_path / "out").mkdir()
    (group,) = export(model, tmp_path / "src", tmp_path / "out")["config_groups"].values()
    weights, acts = group["weights"], group["input_activations"]
    assert group["format"] == "pack-quantized" and (weights["num_bits"], weights["group_size"]) == (4, 32)
    assert (acts["num_bits"], acts["strategy"], acts["dynamic"], acts["symmetric"]) == (8, "token", True, True)


def test_config_names_every_layer_once(tmp_path):
    make_hf_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src", torch.bfloat16)
    apply(model, RTN(4, 32))
    (tmp_path / "out").mkdir()
    qconfig = export(model, tmp_path / "src", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"] == qconfig
    (group,) = qconfig["config_groups"].values()
    assert group["format"] == "pack-quantized" and group["weights"]["group_size"] == 32
    names = [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    assert sorted(group["targets"]) == sorted(names) and qconfig["ignore"] == ["lm_head"]


def test_llm_int8_is_refused(tmp_path):
    make_hf_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src", torch.bfloat16)
    apply(model, LLMInt8())
    with pytest.raises(LeanLMError, match="no scheme"):
        export(model, tmp_path / "src", tmp_path)


def test_cli_export(tiny_dir, tmp_path):
    r = leanlm("quantize", tiny_dir, "--bits", "8", "-o", tmp_path / "w8")
    assert r.returncode == 0, r.stderr
    r = leanlm("export", tmp_path / "w8", "-o", tmp_path / "ct")
    assert r.returncode == 0, r.stderr
    assert "14 pack-quantized" in r.stdout and (tmp_path / "ct" / "tokenizer.json").exists()
    r = leanlm("export", tiny_dir, "-o", tmp_path / "again")
    assert r.returncode == 2 and "not a directory written by `leanlm quantize`" in r.stderr
    assert not (tmp_path / "again").exists()
