"""GGUF export: the gguf reader gets back the weights leanlm computes with, and leanlm's own GGUF loader the logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from leanlm.compress.quant.gguf_export import export_gguf, llama_cpp_pre
from leanlm.compress.quant.rtn import quantize_decoder
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import SCHEMES, W8A8Linear
from leanlm.models.gguf import convert_gguf, gguf_name, open_gguf, unpermute_rotary
from leanlm.models.loading import load_model, to_hf_names
from leanlm.tokenizer import Tokenizer
from tests.models.test_gguf import write_tiny_gguf

TEXT = "the quick brown fox, then the other one."


@pytest.fixture(scope="module", params=[("llama", True), ("qwen2", False)], ids=str)
def source(request, tmp_path_factory):
    """(arch, a tiny random model directory with a byte-level BPE tokenizer): llama tied, qwen2 untied with biases."""
    arch, tied = request.param
    root = tmp_path_factory.mktemp(arch)
    write_tiny_gguf(root / "made.gguf", arch, tied)
    convert_gguf(root / "made.gguf", root / "model", progress=False)
    return arch, root / "model"


def logits(model) -> torch.Tensor:
    tokens = torch.tensor([[1, 5, 9, 3, 17, 30, 2, 44]])
    with torch.inference_mode():
        return model(tokens, torch.arange(tokens.shape[1])[None]).float()


def reread(path, model) -> dict[str, torch.Tensor]:
    """GGUF name -> the float32 weight the gguf reader dequantizes, Q/K rows back in HF order, [rows, cols]."""
    heads = {"attn_q": model.config.num_heads, "attn_k": model.config.num_kv_heads}
    out = {}
    for t in open_gguf(path).tensors:
        w = torch.tensor(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape([int(d) for d in reversed(t.shape)])
        kind = t.name.split(".")[-2]
        if model.config.model_type == "llama" and kind in heads:  # back to HF order, as leanlm's reader does
            w = torch.from_numpy(np.ascontiguousarray(unpermute_rotary(w.numpy(), heads[kind])))
        out[t.name] = w
    return out


def expected(model) -> dict[str, torch.Tensor]:
    """GGUF name -> the float32 weight leanlm computes with (quantized layers dequantized), in HF row order."""
    layers = {n: m for n, m in model.named_modules() if type(m) in SCHEMES.values()}
    sd = {k: v for k, v in model.state_dict().items()
          if not k.startswith("rope_") and not any(k.startswith(n + ".") and not k.endswith(".bias") for n in layers)}
    if model.lm_head_is_embedding:
        sd.pop("lm_head.weight")
    sd |= {f"{n}.weight": m.dequantized_weight() for n, m in layers.items()}
    return {gguf_name(k): v.float() for k, v in to_hf_names(sd, model.config).items()}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dense_model_round_trips_exactly(source, dtype, tmp_path):
    arch, path = source
    model = load_model(path, dtype)
    if dtype == torch.bfloat16:  # a weight float16 cannot hold: leanlm's GGUF loader must keep BF16 as bfloat16
        model.layers[0].mlp.down_proj.weight[0, 0] = 2.0**17
    written = export_gguf(model, path, tmp_path / "out.gguf")
    assert set(written.types) == {"F32", "BF16" if dtype == torch.bfloat16 else "F16"}
    back = reread(tmp_path / "out.gguf", model)
    want = expected(model)
    assert back.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(back[name], w), name
    convert_gguf(tmp_path / "out.gguf", tmp_path / "back", progress=False)  # leanlm's own GGUF loader
    again = load_model(tmp_path / "back", torch.float32)
    assert torch.equal(logits(again), logits(model.float()))
    ours, theirs = Tokenizer(path), Tokenizer(tmp_path / "back")
    assert theirs.encode(TEXT) == ours.encode(TEXT) and theirs.chat_template == ours.chat_template
    assert theirs.eos_token_id == ours.eos_token_id


def test_int8_layers_are_q8_0_with_our_codes(source, tmp_path):
    arch, path = source
    model = load_model(path, torch.bfloat16)
    quantize_decoder(model, "w8a16")
    written = export_gguf(model, path, tmp_path / "q8.gguf")
    assert written.types["Q8_0"] == 7 * model.config.num_layers
    types = {t.name: t.tensor_type for t in open_gguf(tmp_path / "q8.gguf").tensors}
    assert types["blk.0.attn_q.weight"] == Q.Q8_0 and types["token_embd.weight"] == Q.BF16
    back, want = reread(tmp_path / "q8.gguf", model), expected(model)
    for name, w in want.items():
        assert torch.equal(back[name], w), name
    convert_gguf(tmp_path / "q8.gguf", tmp_path / "back", progress=False)
    again = logits(load_model(tmp_path / "back", torch.float32))  # dequantized to float16 by the loader
    ref = logits(model)  # bf16 activations on the int8 kernel
    assert (again - ref).abs().max() < 3e-2 * ref.abs().max()


def test_int4_offsets_float16_cannot_hold_are_refused_unless_rounding_is_allowed(source, tmp_path):
    arch, path = source
    model = load_model(path, torch.bfloat16)
    quantize_decoder(model, "w4a16", group_size=32)
    with pytest.raises(LeanLMError, match="--round-offsets"):
        export_gguf(model, path, tmp_path / "q4.gguf")
    assert not list(tmp_path.iterdir())  # nothing half-written
    written = export_gguf(model, path, tmp_path / "q4.gguf", round_offsets=True)
    assert 0 < written.rounded_offsets < 0.1 * written.offsets
    back, want = reread(tmp_path / "q4.gguf", model), expected(model)
    for name, w in want.items():
        step = w.abs().max() / 7  # a rounded offset moves a weight by far less than a quantization step
        assert (back[name] - w).abs().max() <= step * 2**-8, name
    convert_gguf(tmp_path / "q4.gguf", tmp_path / "back", progress=False)
    ref = logits(model)
    assert (logits(load_model(tmp_path / "back", torch.float32)) - ref).abs().max() < 3e-2 * ref.abs().max()


def test_layers_without_a_gguf_type_are_refused(source, tmp_path):
    _, path = source
    model = load_model(path, torch.float32)
    model.layers[0].mlp.down_proj = W8A8Linear.from_float(model.layers[0].mlp.down_proj)
    with pytest.raises(LeanLMError, match="layers.0.mlp.down_proj is w8a8: GGUF has no type"):
        export_gguf(model, path, tmp_path / "x.gguf")


def test_tokenizers_without_a_llama_cpp_counterpart_are_refused(tiny_dir, tmp_path):
    model = load_model(tiny_dir, torch.float32)  # conftest's tokenizer: Metaspace BPE, not byte-level
    with pytest.raises(LeanLMError, match="byte-level BPE"):
        export_gguf(model, tiny_dir, tmp_path / "x.gguf")
    qwen2 = {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| "
                                                   r"?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}}
    level = {"type": "ByteLevel", "use_regex": False}
    assert llama_cpp_pre({"type": "Sequence", "pretokenizers": [qwen2, level]}) == "qwen2"
    digits = {"type": "Digits", "individual_digits": True}
    assert llama_cpp_pre({"type": "Sequence", "pretokenizers": [digits, {"type": "ByteLevel"}]}) == "smollm"


def test_cli_export_format_gguf(source, tmp_path):
    import subprocess

    from leanlm.bench.serve import leanlm_command

    _, path = source

    def leanlm(*args):
        return subprocess.run(leanlm_command(*map(str, args)), capture_output=True, text=True)

    r = leanlm("export", path, "--format", "gguf", "-o", tmp_path / "m.gguf")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"{path} -> {tmp_path / 'm.gguf'} (GGUF: ") and r.stdout.count("\n") == 1
    assert open_gguf(tmp_path / "m.gguf").tensors
    r = leanlm("export", path, "--format", "gguf", "-o", tmp_path / "m.gguf")
    assert r.returncode == 2 and "already exists" in r.stderr and "Traceback" not in r.stderr
    r = leanlm("export", path, "--format", "onnx", "-o", tmp_path / "m.onnx")
    assert r.returncode == 2 and "compressed-tensors or gguf" in r.stderr
