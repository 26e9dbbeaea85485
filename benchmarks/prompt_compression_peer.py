"""The peer's prompt compression, for benchmarks/prompt_compression.py: the `llmlingua` package's LLMLingua and
LongLLMLingua (Microsoft's reference implementation) with the scorer leanlm uses, in its own virtual environment (the
script imports only llmlingua, transformers and torch; llmlingua passes KV caches as tuples, which transformers 5
no longer takes).

    python -P prompt_compression_peer.py MODEL_DIR TASKS.json OUT.json --mode llmlingua|longllmlingua [--threads 2]

TASKS.json is a list of {"instruction", "context", "question", "rate"}; each context goes in as its paragraphs (split
on blank lines), one document each, so the package's coarse pass ranks units like leanlm's paragraph units.
- llmlingua: compress_prompt(paragraphs, instruction=, question=, rate=) at the package's defaults (its README's
  LLMLingua call): the paragraphs of highest perplexity are kept, in the order of the text, until the budget plus
  100 tokens is spent; then the tokens of lowest perplexity are dropped, 200 tokens of the kept text at a time.
- longllmlingua: the README's LongLLMLingua settings: paragraphs ranked by the question's perplexity after each
  (rank_method="longllmlingua", condition_in_question="after_condition") and kept most relevant first
  (reorder_context="sort": the order of the text is not kept), budget plus 100 tokens (context_budget="+100");
  the token pass keeps the overall rate +0.3 of the most relevant kept paragraph down to -0.3 of the least
  (dynamic_context_compression_ratio=0.3), scoring tokens by how much the question before them changes their
  perplexity (condition_compare=True). The README's `ratio=` is `rate=` in 0.2.2.
The package counts tokens with tiktoken's cl100k (a download, so not to be had offline); here it counts with the
scorer's own tokenizer, so `rate`, origin_tokens and compressed_tokens are in the tokens leanlm counts. MODEL_DIR's
tokenizer_config.json may name a transformers 5 class: the model is loaded through a temporary directory of links
to its files with a tokenizer_config.json naming PreTrainedTokenizerFast.
The first task runs once untimed first (benchmarks/prompt_compression.py does the same for leanlm's methods).
OUT.json: {"load_seconds", "peak_mb": peak RSS, "results": [{"text", "seconds": time of compress_prompt alone,
"origin_tokens", "compressed_tokens"}, ...]} in the order of the tasks.

Setup (llmlingua 0.2.2 needs transformers 4.46):
    python -m venv /work/venvs/llmlingua
    /work/venvs/llmlingua/bin/pip install torch==2.13.0 "transformers==4.46.*" "tokenizers==0.20.*" llmlingua==0.2.2
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from llmlingua import PromptCompressor, prompt_compressor

LONGLLMLINGUA = {"rank_method": "longllmlingua", "condition_in_question": "after_condition", "reorder_context": "sort",
                 "dynamic_context_compression_ratio": 0.3, "condition_compare": True, "context_budget": "+100"}


class ScorerTokens:
    """Stands in for tiktoken's encoding: the scorer's tokenizer, without special tokens."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def linked_model(model_dir: Path, into: Path) -> Path:
    """`into`, holding links to model_dir's files and its tokenizer_config.json naming PreTrainedTokenizerFast."""
    for f in model_dir.iterdir():
        if f.name != "tokenizer_config.json":
            (into / f.name).symlink_to(f.resolve())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (into / "tokenizer_config.json").write_text(json.dumps(config))
    return into


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("tasks", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--mode", choices=("llmlingua", "longllmlingua"), required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tasks = json.loads(args.tasks.read_text())
    options = LONGLLMLINGUA if args.mode == "longllmlingua" else {}

    prompt_compressor.tiktoken = SimpleNamespace(encoding_for_model=lambda name: None)  # no cl100k download
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        compressor = PromptCompressor(model_name=str(linked_model(args.model_dir, Path(tmp))), device_map="cpu")
        load_seconds = time.perf_counter() - t0
    compressor.oai_tokenizer = ScorerTokens(compressor.tokenizer)

    def one(task: dict) -> dict:
        paragraphs = [p for p in re.split(r"\n\s*\n", task["context"]) if p.strip()]
        return compressor.compress_prompt(paragraphs, instruction=task["instruction"], question=task["question"],
                                          rate=task["rate"], **options)

    one(tasks[0])  # untimed, as leanlm's first job: first-call costs out of both timings
    results = []
    for task in tasks:
        t0 = time.perf_counter()
        out = one(task)
        results.append({"text": out["compressed_prompt"], "seconds": time.perf_counter() - t0,
                        "origin_tokens": out["origin_tokens"], "compressed_tokens": out["compressed_tokens"]})
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    args.out.write_text(json.dumps({"load_seconds": load_seconds, "peak_mb": peak_mb, "results": results}))


if __name__ == "__main__":
    main()
