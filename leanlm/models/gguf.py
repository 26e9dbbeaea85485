"""Convert a llama.cpp GGUF file (llama / qwen2) into a Hugging Face-format model directory."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from leanlm.errors import LeanLMError

# GGUF architecture name -> HF class name; the only layouts this converter knows.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def open_gguf(path: Path):
    """Open a GGUF file with gguf.GGUFReader; any parse failure becomes a LeanLMError naming the file."""
    from gguf import GGUFReader  # the gguf package (~30 ms): only a .gguf model needs it

    path = Path(path)
    if not path.is_file():
        raise LeanLMError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise LeanLMError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader fails in many ways on a damaged file; all mean the same to a user
        raise LeanLMError(f"{path}: damaged or truncated GGUF file ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes or t.data_offset + t.n_bytes > size:
            raise LeanLMError(f"{path}: truncated GGUF file (tensor {t.name} runs past the end)")
    return reader


def gguf_architecture(reader, path: Path) -> str:
    """The GGUF `general.architecture`, refused unless it is one this converter supports."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        known = ", ".join(SUPPORTED_ARCHITECTURES)
        raise LeanLMError(f"{Path(path).name}: GGUF architecture {arch!r} is not supported (supported: {known})")
    return arch


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(x: float) -> float:
    # GGUF stores floats as float32; the shortest float32 repr gives back e.g. 1e-05, not 9.99999974e-06.
    return float(str(np.float32(x)))


def hf_config(reader, path: Path) -> dict:
    """A Hugging Face config.json dict for the model in the GGUF file."""
    arch = gguf_architecture(reader, path)
    name = Path(path).name
    g = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    scaling = g("rope.scaling.type", "none")
    if scaling not in (None, "none"):
        raise LeanLMError(f"{name}: RoPE scaling {scaling!r} is not supported (only plain RoPE)")
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", hidden // heads))
    if int(g("rope.dimension_count", head_dim)) != head_dim:
        raise LeanLMError(f"{name}: partial rotary embeddings are not supported")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise LeanLMError(f"{name}: GGUF file has no token_embd.weight tensor")
    has_bias = any(n.endswith(b) for n in tensors for b in _BIASES)
    config = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rope_theta": _f32(g("rope.freq_base", 10000.0)),
        "rms_norm_eps": _f32(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(g("context_length", 2048)),
        # The embedding's rows, not the tokenizer's length: the two can differ (padded vocabularies).
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "bfloat16" if _bf16(tensors["token_embd.weight"]) else "float16",
    }
    if arch == "llama":
        config.update(attention_bias=has_bias, mlp_bias=False)
    for key in ("bos", "eos", "padding"):
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)
    return config


def hf_name(gguf_name: str, num_layers: int, path: Path) -> str:
    """The HF parameter name for a GGUF tensor name; unknown tensors are refused, not dropped."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES and int(m.group(1)) < num_layers:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise LeanLMError(f"{Path(path).name}: tensor {gguf_name!r} has no place in a plain llama/qwen2 model")


def gguf_name(hf: str) -> str:
    """The GGUF tensor name for an HF parameter name (the inverse of hf_name)."""
    for g, h in _GLOBAL_NAMES.items():
        if hf == h:
            return g
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    for g, h in _LAYER_NAMES.items():
        if m and m.group(2) == h:
            return f"blk.{m.group(1)}.{g}"
    raise LeanLMError(f"parameter {hf!r} has no GGUF name in a plain llama/qwen2 model")


def permute_rotary(w, n_heads: int):
    """llama.cpp's Q/K row order from HF's: each head's two rotary halves interleaved (the inverse of
    unpermute_rotary; numpy arrays or torch tensors, rows first)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves each head's two rotary halves)."""
    # llama.cpp's converter maps each head's rows from (2, D/2) order to (D/2, 2) order; swap them back.
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _expected_names(config: dict) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    per_layer = [v for k, v in _LAYER_NAMES.items() if k not in _BIASES]
    if config["model_type"] == "qwen2" or config.get("attention_bias"):
        per_layer += [_LAYER_NAMES[b] for b in _BIASES]
    for i in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{i}.{p}" for p in per_layer)
    return names


def _tensor_plan(reader, config: dict, path: Path) -> list[tuple[Any, str, tuple[int, ...]]]:
    """(GGUF tensor, HF name, HF shape) for every tensor, after checking the set is complete."""
    plan = []
    for t in reader.tensors:
        # GGUF lists dimensions fastest-first; numpy/HF order is the reverse ([out, in]).
        plan.append((t, hf_name(t.name, config["num_hidden_layers"], path), tuple(int(d) for d in reversed(t.shape))))
    missing = _expected_names(config) - {name for _, name, _ in plan}
    if missing:
        raise LeanLMError(f"{Path(path).name}: GGUF file lacks tensors {sorted(missing)[:3]}… for a complete model")
    return plan


def _dequantize(t, shape: tuple[int, ...]) -> np.ndarray:
    from gguf.quants import dequantize  # the gguf package: see open_gguf

    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def _progress(enabled: bool):
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # stderr: a conversion can run inside any verb given a .gguf file, whose stdout is its result
    return Progress(*columns, console=Console(stderr=True), disable=not enabled, transient=False)


def _bf16(t) -> bool:
    from gguf import GGMLQuantizationType  # the gguf package: see open_gguf

    return t.tensor_type == GGMLQuantizationType.BF16


def _as_stored(w: np.ndarray, bf16: bool) -> bytes:
    """float32 values as float16 bytes, or bfloat16 ones for a BF16 tensor (float16 would not hold all of them)."""
    if not bf16:
        return np.ascontiguousarray(w, dtype="<f2").tobytes()
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).bfloat16().view(torch.int16).numpy().tobytes()


def write_weights(reader, config: dict, out_file: Path, path: Path, progress: bool = True) -> None:
    """Dequantize every tensor to float16 (a BF16 one to bfloat16) and stream it into one safetensors file."""
    plan = _tensor_plan(reader, config, path)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t, name, shape in plan:
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16" if _bf16(t) else "F16", "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    with open(out_file, "wb") as f, _progress(progress) as bar:
        task = bar.add_task(f"converting {Path(path).name}", total=len(plan))
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t, _, shape in plan:
            w = _dequantize(t, shape)
            kind = t.name.split(".")[-2]
            if config["model_type"] == "llama" and kind in heads:
                w = unpermute_rotary(w, heads[kind])
            f.write(_as_stored(w, _bf16(t)))
            bar.advance(task)


def write_tokenizer(path: Path, out_dir: Path, max_length: int | None = None) -> None:
    """Rebuild the tokenizer from the GGUF metadata via transformers (chat template in tokenizer_config.json)."""
    from transformers import AutoTokenizer  # heavy: only converting a .gguf model needs it

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise LeanLMError(f"{path.name}: could not rebuild the tokenizer from the GGUF metadata ({e})") from None
    if max_length:
        tok.model_max_length = max_length
    # The classic place for the template, which plain JSON readers and older transformers also find.
    tok.save_pretrained(str(out_dir), save_jinja_files=False)


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write config.json, model.safetensors (float16) and tokenizer files for a GGUF model into out_dir."""
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    reader = open_gguf(gguf_path)
    config = hf_config(reader, gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_weights(reader, config, out_dir / "model.safetensors", gguf_path, progress)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer(gguf_path, out_dir, config["max_position_embeddings"])
