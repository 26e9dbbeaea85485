"""Side by side: what a compressed variant costs in quality and buys in size and speed, against a base model.

Quality runs in this process (one pass per variant scores its perplexity and its KL / top-1 agreement to the
base on the same windows). Speed runs bench.cost in a fresh process per model, so that one model's compiled graphs
and allocator state never touch another's timing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from leanlm.analysis.memory import formula_weight_bytes, lm_head_kind, stored_bytes
from leanlm.bench.cost import isolated
from leanlm.compress.sparse.masks import decoder_sparsity
from leanlm.errors import LeanLMError
from leanlm.eval.datasets import load_text
from leanlm.eval.perplexity import score
from leanlm.models.loading import load
from leanlm.models.zoo import resolve

MB = 2**20


@dataclass(frozen=True)
class Compared:
    model: str
    bits_per_weight: float  # resident weight bits / stored parameters (scales and 16-bit parts included)
    disk_mb: float  # the model's safetensors files: the bytes actually stored
    memory_mb: float  # resident weights, measured
    formula_mb: float  # parameters x bits per weight (scales included)
    perplexity: float
    kl: float  # KL(base || model) per token, nats; 0 for the base
    top1: float  # top-1 agreement with the base; 1 for the base
    tokens: int  # scored tokens of the text
    tokens_per_s: float | None = None  # batch-1 decode, None when speed was not measured
    mbu: float | None = None
    lm_head: str = ""  # how the output projection is stored (analysis.memory.lm_head_kind)
    sparsity: float = 0.0  # share of the decoder projections' weights that are zero (masks.decoder_sparsity)
    pattern: str | None = None  # the N:M pattern all of them follow, e.g. "2:4"

    def to_dict(self) -> dict:
        return asdict(self)


def disk_bytes(path: Path) -> int:
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))


def sizes(net, path: Path) -> dict:
    """A loaded model's resident weights (MB, measured and by formula), its files' size (MB) and its bits per
    stored parameter (scales and 16-bit parts included)."""
    formula, params = formula_weight_bytes(net)
    resident = stored_bytes(net)
    return dict(bits_per_weight=resident * 8 / params, disk_mb=disk_bytes(path) / MB, memory_mb=resident / MB,
                formula_mb=formula / MB)


def quality(base: str, others: list[str], dtype: str = "auto", device: str | None = None,
            max_tokens: int = 16384, data: Path | None = None, progress=None) -> list[Compared]:
    """Perplexity on a text (default: the built-in evaluation text), size, and agreement with `base`, for
    base + others."""
    ref, tok = load(base, dtype, device, progress=False)
    ids = torch.tensor(tok.encode(load_text(data))[:max_tokens])
    rows = []
    for name in [base, *others]:
        net, other_tok = (ref, tok) if name == base else load(name, dtype, device, progress=False)
        if not tok.same_vocabulary(other_tok):
            raise LeanLMError(f"{name} has another tokenizer than {base}; compare variants of one model")
        ppl, agree = score(net, ids, None if net is ref else ref, progress=progress)
        sparsity, pattern = decoder_sparsity(net)
        rows.append(Compared(
            model=name, **sizes(net, resolve(name, progress=False)), perplexity=ppl.perplexity,
            kl=agree.kl if agree else 0.0, top1=agree.top1 if agree else 1.0,
            tokens=ppl.tokens, sparsity=sparsity, pattern=pattern, lm_head=lm_head_kind(net)))
    return rows


def speed(model: str, dtype: str = "auto", threads: int | None = None, compiled: bool = True,
          new_tokens: int = 64) -> dict:
    """Batch-1 decode of `model` on 64 prompt tokens (`leanlm bench`'s measurement), in a fresh process."""
    return isolated(model, model=model, dtype=dtype, compiled=compiled, threads=threads, prompt_tokens=64,
                    new_tokens=new_tokens)
