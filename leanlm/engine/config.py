"""EngineConfig: every option of the serving engine in one frozen dataclass, checked once when it is made."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from leanlm.errors import LeanLMError
from leanlm.models.transformer import Transformer
from leanlm.runtime import parse_memory

KV_CACHES = ("auto", "int8", "int4")  # auto: the model's own dtype; int4 only in the engine's paged pool


def check_kv_cache(value, what: str = "kv_cache", allowed: tuple[str, ...] = KV_CACHES) -> str:
    """The one spelling of the KV-cache choice, checked wherever it is given (engine, CLI, optimize's variants);
    `allowed`: what that place supports (the static caches have no int4)."""
    if value not in allowed:
        hint = ": use auto (16 was its old name)" if str(value) == "16" else ""
        if value == "int4" and "int4" in KV_CACHES:
            hint = ": the int4 KV cache lives in the serving engine's paged pool (leanlm serve, generate --file)"
        names = [f"{a} (the model's dtype)" if a == "auto" else a for a in allowed]
        raise LeanLMError(f"{what} must be {', '.join(names[:-1])} or {names[-1]}, got {value!r}{hint}")
    return value


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and caches (leanlm.engine.Engine, LLM, AsyncLLM, `leanlm serve`).

    kv_cache_memory: the KV pool's budget: "1GiB", a byte count, or a fraction of the memory free when the engine
        starts (0.3); a draft model's keys and values come out of it too.
    block_size: tokens per KV block (the unit of allocation and of prefix sharing).
    max_num_seqs, max_num_batched_tokens: most sequences running together, most tokens fed in one step.
    max_prefill_tokens: most prompt tokens in a step that also decodes (0: what max_num_batched_tokens leaves); a
        smaller share keeps the decoding sequences' time per token steady while prompts arrive, at the cost of the
        new requests' time to first token.
    prefix_caching: reuse the blocks of a prompt prefix computed before.
    kv_cache: "auto" (keys and values in the model's dtype), "int8" (a scale per token and head: about twice the
        tokens in the same memory) or "int4" (cache.int4, KIVI: keys per channel, values per token; about 2.7x the
        bfloat16 tokens; each sequence's filling block's keys and first token exact, for max_num_seqs sequences).
    compile: decode-only steps as compiled graphs (a symbolic batch size: a few graphs, each compiled once).
    deterministic: a request's output independent of its batch, chunking and speculation.
    prompt_lookup: speculate with n-grams of the context up to this size (0: off).
    num_speculative: tokens proposed per step (prompt lookup or draft).
    draft: a model of the target's tokenizer that proposes them: a loaded Transformer (Engine takes only that), or
        a zoo name or path, which LLM and AsyncLLM load with the target's dtype and device.
    pack_weights: on a CPU with AVX512-BF16 or AVX2, a bf16 model that LLM or AsyncLLM load by name or path (as
        `leanlm serve` does) has its Linear layers (and a tied lm_head with its embedding) swapped for
        models.layers.PackedLinear, the weights repacked for leanlm's bf16 kernel (Zen 4: 1.8x torch's GEMM at 32
        rows; Zen 3: 1.2x leanlm's bf16_gemm there, 1.3x at one row). A model object given to them is left as it is
        (models.layers.pack_linears packs one).
    """
    kv_cache_memory: str | int | float = "1GiB"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 1024
    max_prefill_tokens: int = 0
    prefix_caching: bool = True
    kv_cache: str = "auto"
    compile: bool = False
    deterministic: bool = False
    prompt_lookup: int = 0
    num_speculative: int = 4
    draft: Transformer | str | Path | None = None
    pack_weights: bool = True

    def __post_init__(self):
        check_kv_cache(self.kv_cache)
        parse_memory(self.kv_cache_memory, torch.device("cpu"))  # its own message; the engine sizes it on its device
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise LeanLMError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("prompt_lookup", "num_speculative", "max_prefill_tokens"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise LeanLMError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.draft is not None and self.prompt_lookup:
            raise LeanLMError("speculate with a draft model or by prompt lookup, not both")

    @property
    def int8_kv(self) -> bool:
        return self.kv_cache == "int8"

    @property
    def draft_by_name(self) -> bool:
        """The draft is named (a zoo name or a path) and still to be loaded."""
        return isinstance(self.draft, (str, Path))


FIELDS = tuple(f.name for f in fields(EngineConfig))
# LLM's step budget when no config is given: offline nothing waits on a token, so a step takes more of the prompts
# (vLLM's CPU defaults do the same, 4096 for its LLM class against its server's 2048). Measured by
# `python benchmarks/engine.py --sections 2` (the budget sweep); servers keep EngineConfig's 1024 for TPOT.
OFFLINE_BATCHED_TOKENS = 2048


def engine_config(config: EngineConfig | None = None, **options) -> EngineConfig:
    """`config` (default: EngineConfig()) with keyword options, EngineConfig's fields, set over it."""
    for name in options:
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise LeanLMError(f"unknown engine option {name!r}{hint}; the options are {', '.join(FIELDS)}")
    config = config if config is not None else EngineConfig()
    return replace(config, **options) if options else config


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
