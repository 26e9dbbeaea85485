"""ModelConfig: the architecture of a decoder-only model, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from leanlm.errors import LeanLMError

# model_type -> whether q/k/v projections carry a bias by default
SUPPORTED = {"llama": False, "mistral": False, "qwen2": True}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # the seed of the Hadamard rotation down_proj's input gets at run time (QuaRot's online rotation, written by
    # the `rotate` step with online: true; config.json's "leanlm_mlp_rotation"); None: none
    mlp_rotation: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        """Build from a config.json dict; refuse what the decoder does not implement."""
        mtype = d.get("model_type")
        if mtype not in SUPPORTED:
            raise LeanLMError(
                f"unsupported architecture {mtype!r} ({d.get('architectures')}); "
                f"supported: {', '.join(sorted(SUPPORTED))} (Llama, SmolLM2, Mistral, Qwen2 families)"
            )
        scaling = d.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise LeanLMError(f"unsupported rope_scaling {scaling}; only plain RoPE is implemented")
        if d.get("mlp_bias"):
            raise LeanLMError("unsupported config: mlp_bias=true")
        if d.get("hidden_act", "silu") != "silu":
            raise LeanLMError(f"unsupported hidden_act {d.get('hidden_act')!r}; only silu (SwiGLU) is implemented")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        max_pos = d.get("max_position_embeddings", 2048)
        if d.get("sliding_window") and d.get("use_sliding_window", mtype == "mistral"):
            max_pos = min(max_pos, d["sliding_window"])  # we do not implement windowed attention: cap context
        return cls(
            model_type=mtype,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position=max_pos,
            rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            qkv_bias=d.get("attention_bias", SUPPORTED[mtype]),
            tie_embeddings=d.get("tie_word_embeddings", False),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            mlp_rotation=d.get("leanlm_mlp_rotation"),
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        file = Path(path) / "config.json"
        try:
            return cls.from_hf(json.loads(file.read_text()))
        except FileNotFoundError:
            raise LeanLMError(f"{path}: no config.json (expected a Hugging Face model directory)") from None
        except (json.JSONDecodeError, KeyError) as e:
            raise LeanLMError(f"{file}: not a valid model config ({type(e).__name__}: {e})") from None

    def to_dict(self) -> dict:
        return asdict(self)

    def check_portable(self, runtime: str) -> None:
        """Refuse to write the model for another runtime when it needs a piece only leanlm runs."""
        if self.mlp_rotation is not None:
            raise LeanLMError(f"{runtime} cannot run this model: its down_proj input is rotated at run time (the "
                              "`rotate` step with online: true), which only leanlm does; rotate offline only to "
                              "export it")


def hf_config_dict(config: ModelConfig, base: dict) -> dict:
    """The source model's config.json dict `base` with the shape of `config` (e.g. after structured pruning).

    head_dim is always written: once heads are removed, hidden_size / num_attention_heads no longer gives it, and
    transformers' Llama, Mistral and Qwen2 read an explicit head_dim first. Per-layer lists (`layer_types`) keep
    one entry per remaining layer."""
    out = dict(base, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
               num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
               num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
               tie_word_embeddings=config.tie_embeddings)
    out.pop("leanlm_mlp_rotation", None)
    if config.mlp_rotation is not None:
        out["leanlm_mlp_rotation"] = config.mlp_rotation
    if isinstance(base.get("layer_types"), list):
        out["layer_types"] = base["layer_types"][: config.num_layers]
    if isinstance(base.get("max_window_layers"), int):
        out["max_window_layers"] = min(base["max_window_layers"], config.num_layers)
    return out


def write_hf_config(config: ModelConfig, source: Path, out: Path, dtype: str) -> None:
    """`out`/config.json: `source`'s config.json with the shape of `config` (hf_config_dict) and its dtype key
    (torch_dtype or dtype, as the source spells it) naming `dtype`, what the saved weights are in. The one writer
    of config.json for a saved model, float or quantized: a copy of the source's would describe the model before
    structured pruning, and the smaller weights would not load."""
    base = json.loads((Path(source) / "config.json").read_text())
    written = hf_config_dict(config, base)
    for key in [k for k in ("torch_dtype", "dtype") if k in base] or ["torch_dtype"]:
        written[key] = dtype
    (Path(out) / "config.json").write_text(json.dumps(written, indent=2))
