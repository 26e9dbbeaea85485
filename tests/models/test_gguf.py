"""GGUF -> HF directory conversion, checked against known weights and against transformers' own GGUF loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from leanlm.errors import LeanLMError
from leanlm.models.gguf import convert_gguf

DIMS = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, layers=2)

# A tiny byte-level BPE vocabulary: 3 specials, 26 letters, a few merges.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "t h", "i n", "a n", "e r", "o n", "r e", "a t", "e n", "e s", "o r", "e d", "i s"]
TOKENS = SPECIALS + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", ".", ","]
TOKENS += ["".join(m.split()) for m in MERGES] + ["it"]
VOCAB = len(TOKENS)  # 48
CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

# The storage type of each GGUF tensor kind: float and block-quantized types, quantized Q/K included.
QTYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q8_0,
    "attn_q": Q.Q8_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.F16,
    "attn_output": Q.Q5_0,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.F16,
    "ffn_down": Q.Q8_0,
}


def hf_weights(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-named float32 weights for a tiny llama/qwen2 model."""
    rng = np.random.default_rng(seed)
    d, h, kv, hd, f = DIMS["hidden"], DIMS["heads"], DIMS["kv_heads"], DIMS["head_dim"], DIMS["ffn"]
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.1  # noqa: E731
    w = {"model.embed_tokens.weight": r(VOCAB, d), "model.norm.weight": 1 + r(d)}
    if not tied:
        w["lm_head.weight"] = r(VOCAB, d)
    for i in range(DIMS["layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": 1 + r(d),
            p + "post_attention_layernorm.weight": 1 + r(d),
            p + "self_attn.q_proj.weight": r(h * hd, d),
            p + "self_attn.k_proj.weight": r(kv * hd, d),
            p + "self_attn.v_proj.weight": r(kv * hd, d),
            p + "self_attn.o_proj.weight": r(d, h * hd),
            p + "mlp.gate_proj.weight": r(f, d),
            p + "mlp.up_proj.weight": r(f, d),
            p + "mlp.down_proj.weight": r(d, f),
        }
        if arch == "qwen2":
            w |= {p + "self_attn.q_proj.bias": r(h * hd), p + "self_attn.k_proj.bias": r(kv * hd)}
            w[p + "self_attn.v_proj.bias"] = r(kv * hd)
    return w


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, i, rest = hf.split(".", 3)
    for k, v in GGUF_NAMES.items():
        if rest.startswith(k):
            return f"blk.{i}.{v}{rest[len(k):]}"
    raise KeyError(hf)


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to llama Q/K rows: each head's halves interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def stored(w: np.ndarray, qtype: Q) -> np.ndarray:
    """The values a GGUF reader gets back for `w` stored as `qtype`."""
    if qtype == Q.F32:
        return w
    return dequantize(quantize(w, qtype), qtype).reshape(w.shape).astype(np.float32)


def write_tiny_gguf(path: Path, arch: str = "llama", tied: bool = True, extra: dict | None = None) -> dict:
    """Write a tiny random model as GGUF the way llama.cpp would; return the HF weights a reader should see."""
    weights = hf_weights(arch, tied)
    writer = GGUFWriter(path, arch)
    writer.add_block_count(DIMS["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(DIMS["hidden"])
    writer.add_feed_forward_length(DIMS["ffn"])
    writer.add_head_count(DIMS["heads"])
    writer.add_head_count_kv(DIMS["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(DIMS["head_dim"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT)
    expected = {}
    for hf, w in weights.items():
        name = gguf_name(hf)
        kind = name.split(".")[-2]
        qtype = QTYPES.get(kind, Q.F32) if w.ndim == 2 else Q.F32
        # Block quantization works row by row, so permuting rows commutes with it.
        expected[hf] = stored(w, qtype)
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            w = llama_cpp_permute(w, DIMS["heads"] if kind == "attn_q" else DIMS["kv_heads"])
        if qtype == Q.F32:
            writer.add_tensor(name, w)
        elif qtype == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)
    for name, w in (extra or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture(scope="module", params=[("llama", True), ("llama", False), ("qwen2", False)], ids=str)
def converted(request, tmp_path_factory):
    arch, tied = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{tied}")
    gguf_path = root / "tiny.gguf"
    expected = write_tiny_gguf(gguf_path, arch, tied)
    convert_gguf(gguf_path, root / "out", progress=False)
    return arch, tied, gguf_path, root / "out", expected


def test_weights_are_the_dequantized_originals(converted):
    arch, tied, _, out, expected = converted
    ours = load_file(out / "model.safetensors")
    assert set(ours) == set(expected)
    for name, w in expected.items():
        assert ours[name].dtype == torch.float16
        assert torch.equal(ours[name], torch.from_numpy(w).half()), name


def test_weights_match_transformers_gguf_loader(converted):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, _, gguf_path, out, _ = converted
    # from_pretrained(gguf_file=...) needs `accelerate`; this is the loader it calls underneath.
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    ref = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_file(out / "model.safetensors")
    assert set(ours) == set(ref)
    for name, w in ref.items():
        assert torch.equal(ours[name], w.half()), name


def test_config_matches_transformers_and_loads(converted):
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, tied, gguf_path, out, _ = converted
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    assert raw["vocab_size"] == VOCAB and raw["tie_word_embeddings"] is tied
    assert raw["head_dim"] == DIMS["head_dim"] and raw["rms_norm_eps"] == 1e-5 and raw["rope_theta"] == 10000.0
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["torch_dtype"]) == (1, 2, "float16")
    if arch == "llama":
        assert raw["attention_bias"] is False
    ref = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = AutoConfig.from_pretrained(out)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings"):
        assert getattr(ours, key) == getattr(ref, key), key
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_tokenizer_and_chat_template(converted):
    from transformers import AutoTokenizer

    _, _, _, out, _ = converted
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == VOCAB
    assert tok.convert_ids_to_tokens(tok(" the")["input_ids"]) == ["Ġthe"]
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def test_conversion_progress_goes_to_stderr(tmp_path, capsys):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "converting tiny.gguf" in captured.err


def test_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello, not a model\n")
    with pytest.raises(LeanLMError, match="notes.gguf.*not a GGUF file"):
        convert_gguf(bad, tmp_path / "out", progress=False)


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_gguf_is_refused(tmp_path, keep):
    full = tmp_path / "tiny.gguf"
    write_tiny_gguf(full)
    data = full.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(LeanLMError, match="cut.gguf.*truncated"):
        convert_gguf(cut, tmp_path / "out", progress=False)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(LeanLMError, match="nothere.gguf"):
        convert_gguf(tmp_path / "nothere.gguf", tmp_path / "out", progress=False)


def test_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LeanLMError, match="'gpt2' is not supported.*llama, qwen2"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_unknown_tensor_is_refused(tmp_path):
    # e.g. llama 3.1's rope_freqs: silently dropping it would give a subtly wrong model.
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, extra={"rope_freqs.weight": np.ones(DIMS["head_dim"] // 2, np.float32)})
    with pytest.raises(LeanLMError, match="rope_freqs.weight"):
        convert_gguf(path, tmp_path / "out", progress=False)
