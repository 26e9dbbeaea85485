"""Hugging Face model directory (config.json + *.safetensors + tokenizer) <-> Transformer."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from leanlm.errors import LeanLMError
from leanlm.models.config import ModelConfig
from leanlm.models.layers import rope_table
from leanlm.models.transformer import Transformer
from leanlm.runtime import weights_on_huge_pages

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise LeanLMError(f"unknown dtype {name!r}; choose one of: float32, bfloat16, float16") from None


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in a directory (no pickle involved)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise LeanLMError(f"{path}: no *.safetensors weights found")
    tensors = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise LeanLMError(f"{file}: cannot read weights ({e})") from None
    return tensors


def hf_to_leanlm(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename HF weights to ours, fusing q/k/v and gate/up into one projection each."""
    out = {}
    strip = lambda name: name.removeprefix("model.")  # noqa: E731
    for name, t in sd.items():
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name or "rotary_emb" in name:
            continue
        out[strip(name)] = t
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        try:
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                out[f"layers.{i}.self_attn.qkv_proj.{kind}"] = torch.cat(
                    [sd[f"{p}self_attn.{n}_proj.{kind}"] for n in "qkv"])
            out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
                [sd[f"{p}mlp.gate_proj.weight"], sd[f"{p}mlp.up_proj.weight"]])
        except KeyError as e:
            raise LeanLMError(f"weights are missing tensor {e.args[0]}") from None
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def leanlm_to_hf(model: Transformer) -> dict[str, torch.Tensor]:
    """Our state dict in HF names (q/k/v and gate/up split again), e.g. for saving or for transformers."""
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return to_hf_names(sd, model.config)


def to_hf_names(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Tensors under our names to HF names; a fused projection's tensors (any whose rows are its output
    features) split by rows into q/k/v or gate/up."""
    out = {}
    for name, t in sd.items():
        if name.startswith("rope_"):
            continue
        if ".qkv_proj." in name:
            for n, part in zip("qkv", t.split([cfg.q_size, cfg.kv_size, cfg.kv_size])):
                out["model." + name.replace("qkv_proj", f"{n}_proj")] = part.contiguous()
        elif ".gate_up_proj." in name:
            for n, part in zip(("gate", "up"), t.chunk(2)):
                out["model." + name.replace("gate_up_proj", f"{n}_proj")] = part.contiguous()
        else:
            out[name if name.startswith("lm_head") else "model." + name] = t.contiguous()
    return out


def load_model(path: Path, dtype: torch.dtype | str = torch.bfloat16, device: str | torch.device = "cpu") -> Transformer:
    """A Transformer with the weights of a HF directory, in `dtype` on `device`.

    A directory written by `leanlm quantize` (it has quantization.json) gets its quantized modules back;
    their packed weights and scales keep the dtypes their kernels need, everything else takes `dtype`.
    """
    from leanlm.compress.quant import format as qformat

    cfg = ModelConfig.from_dir(path)
    dtype = parse_dtype(dtype)
    with torch.device("meta"):
        model = Transformer(cfg)
    ours = qformat.is_quantized(path)  # written by qformat.save: our names, not HF's
    quantized = qformat.restore_modules(model, path) if ours else set()
    sd = read_safetensors(path) if ours else hf_to_leanlm(read_safetensors(path), cfg)
    # copy=True: kernels such as _weight_int8pack_mm need their own aligned allocation, not a view into the file
    sd = {k: v.to(device, copy=True) if any(k.startswith(q) for q in quantized) else v.to(device=device, dtype=dtype)
          for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    del sd  # the model holds the tensors now; moving them to huge pages below frees each old one as it goes
    missing = [m for m in missing if not m.startswith("rope_") and not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise LeanLMError(f"{path}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if cfg.tie_embeddings and "lm_head." not in quantized:  # a quantized lm_head has its own weights
        model.lm_head.weight = model.embed_tokens.weight
    model.rope_cos, model.rope_sin = rope_table(cfg, device=device)
    model.eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        weights_on_huge_pages(model)
    return model
