"""GGUF export: perplexity of each exported file in llama.cpp next to leanlm's, on the same tokens and windows.

    python benchmarks/gguf_export.py [--model smollm2-135m] [--max-tokens 4096] [--window 1024] [--stride 512]

Needs llama-cpp-python (`CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" pip install llama-cpp-python==0.3.36`).
Each variant is made as a user would: `leanlm quantize` (cached in $LEANLM_CACHE/bench-gguf/), then `leanlm export
--format gguf`. The text is the first --max-tokens tokens of the built-in evaluation text, tokenized once by leanlm;
both runtimes get those token ids (llama.cpp's own tokenization of the text is compared with them and reported) and
score them in leanlm's windows (leanlm.eval.perplexity.windows). Columns: leanlm running the quantized directory
itself (its kernels, bf16 activations); leanlm running the exported GGUF (its GGUF loader dequantizes to float16,
computed in float32); llama.cpp running the GGUF (float32 activations, its own quantized dot products); and how far
llama.cpp's next-token distributions are from leanlm's on that same file (KL, top-1 agreement).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from leanlm.models.loading import load
from leanlm.bench.serve import leanlm_command
from leanlm.eval.datasets import load_text
from leanlm.eval.perplexity import perplexity, windows
from leanlm.fetch import cache_dir
from leanlm.models.gguf import open_gguf
from leanlm.models.zoo import resolve

err = Console(stderr=True)
# name -> (`leanlm quantize` options or None for the float model, `leanlm export` options)
VARIANTS = {
    "16-bit": (None, []),
    "rtn w8a16": (["--method", "rtn", "--bits", "8", "--lm-head", "16"], []),
    "rtn w8a16 + int8 head": (["--method", "rtn", "--bits", "8", "--lm-head", "8"], []),
    "rtn w4a16 g32": (["--method", "rtn", "--bits", "4", "--group-size", "32", "--lm-head", "16"], ["--round-offsets"]),
}


def run(*args: str) -> None:
    subprocess.run(leanlm_command(*args), check=True, stdout=sys.stderr)


def variant_files(model: str, name: str) -> tuple[str, Path]:
    """(what leanlm runs, the exported GGUF), made by the CLI unless a previous run left them."""
    quantize, export = VARIANTS[name]
    root = cache_dir() / "bench-gguf" / model / name.replace(" ", "-").replace("+", "")
    source = model if quantize is None else str(root / "model")
    if quantize is not None and not (root / "model").exists():
        run("quantize", model, *quantize, "-o", str(root / "model"))
    gguf = root / "model.gguf"
    if not gguf.exists():
        root.mkdir(parents=True, exist_ok=True)
        run("export", source, "--format", "gguf", "-o", str(gguf), *export)
    return source, gguf


def llama_cpp_scores(path: Path, ids: list[int], window: int, stride: int, threads: int):
    """llama.cpp's (mean NLL, log-probs of every scored position [n, V]) over leanlm's windows."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=window, n_batch=window, n_ubatch=window, logits_all=True,
                n_threads=threads, verbose=False)
    nll, logps = 0.0, []
    for begin, end, first in windows(len(ids), window, stride):
        llm.reset()
        llm.eval(ids[begin:end])
        logits = torch.from_numpy(np.array(llm.scores[first - begin - 1:end - begin - 1], dtype=np.float32))
        targets = torch.tensor(ids[first:end])
        nll += F.cross_entropy(logits, targets, reduction="sum").item()
        logps.append(logits.log_softmax(-1))
    text_ids = llm.tokenize(load_text(None).encode(), add_bos=False, special=False)
    return nll / sum(len(p) for p in logps), torch.cat(logps), text_ids


@torch.inference_mode()
def leanlm_scores(model, ids: list[int], window: int, stride: int):
    """leanlm's (mean NLL, log-probs of every scored position [n, V]) over the same windows."""
    nll, logps = 0.0, []
    t = torch.tensor(ids)
    for begin, end, first in windows(len(ids), window, stride):
        logits = model(t[begin:end][None], torch.arange(end - begin)[None])[0, first - begin - 1:end - begin - 1]
        nll += F.cross_entropy(logits.float(), t[first:end], reduction="sum").item()
        logps.append(logits.float().log_softmax(-1))
    return nll / sum(len(p) for p in logps), torch.cat(logps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--stride", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    resolve(args.model)
    _, tok = load(args.model, "float32")
    text_ids = tok.encode(load_text(None))
    ids = text_ids[:args.max_tokens]
    table = Table(title=f"{args.model}: perplexity on {len(ids) - 1} predictions of the built-in evaluation text "
                        f"(windows {args.window}, stride {args.stride}, the same token ids for both runtimes)")
    for col in ("variant", "GGUF tensors", "file MB", "leanlm (its model)", "leanlm (the GGUF)",
                "llama.cpp (the GGUF)", "KL llama.cpp | leanlm", "top-1 same", "same tokenization"):
        table.add_column(col, justify="left" if col in ("variant", "GGUF tensors") else "right")
    for name in VARIANTS:
        source, gguf = variant_files(args.model, name)
        counts: dict[str, int] = {}
        for t in open_gguf(gguf).tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        own = perplexity(load(source)[0], torch.tensor(ids), args.window, args.stride).perplexity
        file_nll, file_logp = leanlm_scores(load(str(gguf), "float32")[0], ids, args.window, args.stride)
        cpp_nll, cpp_logp, cpp_text_ids = llama_cpp_scores(gguf, ids, args.window, args.stride, args.threads)
        kl = (cpp_logp.exp() * (cpp_logp - file_logp)).sum(-1).mean().item()
        top1 = (cpp_logp.argmax(-1) == file_logp.argmax(-1)).float().mean().item()
        same_tok = "yes" if cpp_text_ids == text_ids else f"no ({len(cpp_text_ids)} vs {len(text_ids)} tokens)"
        table.add_row(name, ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
                      f"{gguf.stat().st_size / 2**20:.0f}", f"{own:.3f}", f"{math.exp(file_nll):.3f}", f"{math.exp(cpp_nll):.3f}", f"{kl:.5f}",
                      f"{top1:.1%}", same_tok)
        err.print(f"[dim]{name} done[/]")
    Console(width=220).print(table)  # whole numbers when piped: rich would cut cells to 80 columns


if __name__ == "__main__":
    main()
