"""Hugging Face model directory (config.json + *.safetensors + tokenizer) <-> Transformer."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from leanlm.errors import LeanLMError
from leanlm.lowbit import record
from leanlm.models.config import ModelConfig
from leanlm.models.layers import rope_table
from leanlm.models.transformer import Transformer
from leanlm.models.zoo import resolve
from leanlm.runtime import default_dtype, empty_on_huge_pages, resolve_device
from leanlm.tokenizer import Tokenizer

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


def hf_parts(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, list[torch.Tensor]]:
    """Our name -> the HF tensors whose rows, stacked in order, make it (q/k/v and gate/up fuse; the rest are one
    tensor each), so that a loader can write each weight once into its final place."""
    out = {}
    strip = lambda name: name.removeprefix("model.")  # noqa: E731
    for name, t in sd.items():
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name or "rotary_emb" in name:
            continue
        out[strip(name)] = [t]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        try:
            for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
                out[f"layers.{i}.self_attn.qkv_proj.{kind}"] = [sd[f"{p}self_attn.{n}_proj.{kind}"] for n in "qkv"]
            out[f"layers.{i}.mlp.gate_up_proj.weight"] = [sd[f"{p}mlp.gate_proj.weight"], sd[f"{p}mlp.up_proj.weight"]]
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
    cfg = ModelConfig.from_dir(path)
    dtype = parse_dtype(dtype)
    with torch.device("meta"):
        model = Transformer(cfg)
    ours = record.is_quantized(path)  # written by compress.quant.format.save: our names, not HF's
    quantized = record.restore_modules(model, path) if ours else set()
    files = read_safetensors(path)  # memory-mapped: nothing is read until the copies below
    parts = {k: [v] for k, v in files.items()} if ours else hf_parts(files, cfg)
    rope = dict(zip(("rope_cos", "rope_sin"), rope_table(cfg)))
    # Quantized modules keep their tensors' stored dtypes (their kernels need them), everything else takes `dtype`.
    specs = {k: (_stacked_shape(ps), ps[0].dtype if any(k.startswith(q) for q in quantized) else dtype)
             for k, ps in parts.items()}
    sd = _empty(specs | {k: (v.shape, v.dtype) for k, v in rope.items()}, torch.device(device))
    for name, ps in (parts | {k: [v] for k, v in rope.items()}).items():
        _fill(sd[name], ps)  # the one pass over the file: fuses, converts dtype and lands in the final buffer
    del files, parts
    rope = {k: sd.pop(k) for k in rope}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise LeanLMError(f"{path}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.rope_cos, model.rope_sin = rope["rope_cos"], rope["rope_sin"]  # not in a state dict: set by hand
    if cfg.tie_embeddings and "lm_head." not in quantized:  # a quantized lm_head has its own weights
        model.lm_head.weight = model.embed_tokens.weight
    model.eval().requires_grad_(False)
    return model


def _empty(specs: dict[str, tuple[torch.Size, torch.dtype]], device: torch.device) -> dict[str, torch.Tensor]:
    """Uninitialised tensors of these shapes and dtypes: on a CPU, all in one buffer on 2 MiB pages (see
    runtime.empty_on_huge_pages), else each its own."""
    if device.type == "cpu" and (arena := empty_on_huge_pages(list(specs.values()))) is not None:
        return dict(zip(specs, arena))
    return {k: torch.empty(shape, dtype=dt, device=device) for k, (shape, dt) in specs.items()}


def _stacked_shape(parts: list[torch.Tensor]) -> torch.Size:
    """The shape of `parts` stacked by rows (a lone tensor's own shape, a 0-dim scale's included)."""
    if len(parts) == 1:
        return parts[0].shape
    return torch.Size([sum(p.shape[0] for p in parts), *parts[0].shape[1:]])


def _fill(dest: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """Copy `parts` stacked by rows into `dest`, converting dtype on the way."""
    if len(parts) == 1:
        _copy(dest, parts[0])
        return
    at = 0
    for part in parts:
        _copy(dest.narrow(0, at, part.shape[0]), part)
        at += part.shape[0]


_HALVES = (torch.float16, torch.bfloat16)
_CHUNK = 1 << 18  # elements: a 1 MiB float32 scratch stays in cache


def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    """dest.copy_(src), but float16 <-> bfloat16 on a CPU goes through float32 a chunk at a time (the same
    rounding): torch's direct conversion ran 3x slower (98 vs 31 ms for 32 Mi weights, Zen 4), and the zoo's
    float16 files load as bfloat16 by default."""
    if not (dest.is_cpu and src.is_cpu and {dest.dtype, src.dtype} == set(_HALVES) and dest.is_contiguous()):
        dest.copy_(src)
        return
    d, s = dest.view(-1), src.reshape(-1)
    scratch = torch.empty(min(_CHUNK, d.numel()))
    for i in range(0, d.numel(), _CHUNK):
        n = min(_CHUNK, d.numel() - i)
        d[i:i + n].copy_(scratch[:n].copy_(s[i:i + n]))


def load(model: str | Path, dtype: str | torch.dtype | None = None, device: str | None = None,
         progress: bool = True) -> tuple[Transformer, Tokenizer]:
    """A zoo name, HF directory or .gguf file -> (model, tokenizer); pulls zoo models on first use."""
    path = resolve(str(model), progress=progress)
    dev = resolve_device(device)
    dt = default_dtype(dev) if dtype in (None, "auto") else parse_dtype(dtype)
    return load_model(path, dt, dev), Tokenizer(path)
