"""What a sweep tries: variants of one model, each a compression recipe plus the runtime options it runs with."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from leanlm.pipeline import method
from leanlm.engine.config import check_kv_cache
from leanlm.errors import LeanLMError

DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Variant:
    """One point of the sweep: `steps` as `leanlm quantize/prune --recipe` takes them (none: the model as it is),
    in `dtype`, decoding with a KV cache in that dtype (kv_cache auto) or int8, optionally speculating with prompt
    lookup (n-grams up to `prompt_lookup`) or with a `draft` model of the same tokenizer."""

    name: str
    steps: tuple[dict, ...] = ()
    dtype: str = "bfloat16"
    kv_cache: str = "auto"
    prompt_lookup: int = 0
    draft: str = ""
    notes: str = ""

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise LeanLMError(f"variant {self.name}: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check_kv_cache(self.kv_cache, f"variant {self.name}: kv_cache", ("auto", "int8"))
        if self.draft and self.prompt_lookup:
            raise LeanLMError(f"variant {self.name}: speculate with a draft or with prompt lookup, not both")
        for step in self.steps:
            if not isinstance(step, dict) or "method" not in step:
                raise LeanLMError(f"variant {self.name}: each step is a mapping with a method, got {step!r}")
            method(step["method"])  # an unknown method fails here, naming the known ones

    @property
    def builds_model(self) -> bool:
        return bool(self.steps)

    @property
    def prunes(self) -> bool:
        return any(method(s["method"]).kind == "prune" for s in self.steps)

    def model_key(self) -> str:
        """Names the built model: only what changes the weights."""
        return digest({"steps": self.steps, "dtype": self.dtype})

    def to_dict(self) -> dict:
        return asdict(self)


def digest(obj) -> str:
    """A short stable name for a JSON-able value: the cache keys of builds and measurements."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=list).encode()).hexdigest()[:16]


W8 = {"method": "rtn", "bits": 8}
HEAD8 = {"method": "lm_head", "bits": 8}
HEAD8_G = {"method": "lm_head", "bits": 8, "group_size": 128}


def _w4(method_name: str) -> tuple[dict, ...]:
    return ({"method": method_name, "bits": 4, "group_size": 128}, HEAD8_G)


QUICK = (
    Variant("bf16"),
    Variant("w8+head8", (W8, HEAD8_G), notes="RTN int8 per channel, int8 lm_head"),
    Variant("w8+head8 lookup", (W8, HEAD8_G), prompt_lookup=3, notes="prompt lookup: speed on input-grounded prompts"),
    Variant("w8a8 smooth", ({"method": "smooth"}, {"method": "rtn", "bits": 8, "act_bits": 8}),
            notes="SmoothQuant, then int8 weights and per-token int8 activations"),
    Variant("w4 rtn g128+head8", _w4("rtn")),
    Variant("w4 gptq g128+head8", _w4("gptq")),
)

DEFAULT = (
    *QUICK,
    Variant("w8", (W8,), notes="RTN int8 per channel, 16-bit lm_head"),
    Variant("w8+head8 kv8", (W8, HEAD8_G), kv_cache="int8"),
    Variant("fp16", dtype="float16"),
    Variant("w4 awq g128+head8", _w4("awq")),
    Variant("w4 gptq g32+head8", ({"method": "gptq", "bits": 4, "group_size": 32}, HEAD8_G)),
    Variant("w4a8 gptq g128+head8", ({"method": "gptq", "bits": 4, "group_size": 128, "act_bits": 8}, HEAD8_G),
            notes="GPTQ int4 weights with per-token int8 activations: int8 products for many sequences"),
    Variant("w4a8 rotated gptq g128+head8", ({"method": "rotate", "online": True},
                                             {"method": "gptq", "bits": 4, "group_size": 128, "act_bits": 8}, HEAD8_G),
            notes="QuaRot's Hadamard rotations (folded into the weights, and online on down_proj's input) before "
                  "GPTQ W4A8: under a third of its gap without them"),
    Variant("w4 rotated gptq g128+distill+head8",
            ({"method": "rotate"}, {"method": "gptq", "bits": 4, "group_size": 128},
             {"method": "distill", "steps": 100}, HEAD8_G),
            notes="QuaRot's rotations, GPTQ, then 100 steps of end-to-end distillation of the group scales: the best "
                  "4-bit quality"),
    Variant("bf16 kv8", kv_cache="int8"),
    Variant("bf16 lookup", prompt_lookup=3),
    Variant("wanda 2:4 + w8", ({"method": "wanda", "pattern": "2:4"}, W8, HEAD8_G)),
    Variant("neurons 0.9 + w8", ({"method": "neurons", "target_params": 0.9}, W8, HEAD8_G),
            notes="10% of the parameters cut by MLP neurons, no retraining"),
    Variant("aqlm 2x8, down/o 3x8+head8",
            ({"method": "aqlm", "bits": 2, "iters": 50,
              "layers": {"layers.*.mlp.down_proj": 3, "layers.*.self_attn.o_proj": 3}},
             {"method": "distill", "steps": 100}, HEAD8_G),
            notes="~2.5 bits a projection weight (two additive codebooks, three on down_proj and o_proj, then 100 "
                  "steps of end-to-end distillation): the smallest model, at a quality cost"),
    Variant("neurons 0.75 + distill + w8", ({"method": "neurons", "target_params": 0.75},
                                            {"method": "distill", "minutes": 10}, W8, HEAD8_G),
            notes="25% of the parameters cut by MLP neurons, then 10 minutes of distillation from the original"),
)


DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}  # zoo models with a smaller sibling of the same tokenizer


def draft_variants(model: str) -> tuple[Variant, ...]:
    """Speculative decoding with the model's zoo draft, when it has one."""
    draft = DRAFTS.get(model)
    return () if draft is None else (Variant(f"bf16 draft {draft}", draft=draft, notes="speed on code prompts"),
                                     Variant(f"w8+head8 draft {draft}", (W8, HEAD8_G), draft=draft))


def read_variants(spec: str | Path) -> tuple[Variant, ...]:
    """`default`, `quick`, or a YAML file: a list of {name, steps: [...], dtype, kv_cache, prompt_lookup, draft}."""
    if str(spec) in ("default", "quick"):
        return DEFAULT if str(spec) == "default" else QUICK
    path = Path(spec)
    if not path.is_file():
        raise LeanLMError(f"--recipes {spec}: not a file (or use default / quick)")
    try:
        items = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise LeanLMError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(items, list) or not all(isinstance(i, dict) and "name" in i for i in items):
        raise LeanLMError(f"{path}: expected a list of variants, each with a name (and steps, dtype, kv_cache, "
                          "prompt_lookup)")
    known = set(Variant.__dataclass_fields__)
    variants = []
    for item in items:
        extra = set(item) - known
        if extra:
            raise LeanLMError(f"{path}: variant {item['name']} has unknown keys {sorted(extra)}; known: {sorted(known)}")
        variants.append(Variant(**{**item, "name": str(item["name"]), "steps": tuple(item.get("steps") or ()),
                                   "kv_cache": str(item.get("kv_cache", "auto"))}))
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise LeanLMError(f"{path}: variant names must be unique")
    return tuple(variants)

