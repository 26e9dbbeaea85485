"""Does compression make the server faster? leanlm bf16 against its W8A16, W8A8 (SmoothQuant), W4A16 and W4A8 variants
of the same model, and llama-server on the W8A16 and W4A16 weights as leanlm exports them to GGUF (Q8_0, Q4_1), each
served as a user starts it and loaded by `leanlm bench serve --sweep` (random token ids, each level its own, 256 in /
128 out, greedy, ignore_eos), one server at a time, no warm-up beyond the one request each bench run sends.

    python benchmarks/serving_variants.py [--model smollm2-135m] [--levels 1,4,16,32] [--compile]
                                          [--no-llama | --llama-only] [--variants W8A16,W8A8,W4A16,W4A8,unpacked]

Prints output tokens/s (and median TPOT) per variant and concurrency, and each variant's ratio to leanlm bf16. The
variants are made once with `leanlm quantize` and `leanlm export --format gguf` into ~/.cache/leanlm/bench (as
benchmarks/serving.py makes them); llama-server as benchmarks/serving.py runs it (LEANLM_LLAMA_SERVER).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from serving import LLAMA_SERVER, NAME, llama_server  # noqa: I001  (this folder)
from leanlm.bench.probe import device_name
from leanlm.bench.serve import leanlm_command
from leanlm.models.zoo import resolve

CACHE = Path.home() / ".cache/leanlm/bench"
VARIANTS = {"W8A16 (rtn)": ("--method", "rtn", "--bits", "8"), "W8A8 (SmoothQuant)": ("--method", "smoothquant"),
            "W4A16 (rtn, g128)": ("--method", "rtn", "--bits", "4"),
            "W4A8 (rtn, g128)": ("--method", "rtn", "--bits", "4", "--act-bits", "8")}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def quantized(model: str, label: str, args: tuple[str, ...]) -> str:
    path = CACHE / f"{Path(model).name}-{label.split()[0].lower()}"
    if not path.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        log(f"quantizing {model} -> {path}")
        subprocess.run(leanlm_command("quantize", model, *args, "-o", str(path)), check=True, stdout=sys.stderr)
    return str(path)


def sweep(target: str, levels: list[int], *args: str) -> dict[int, dict]:
    """One `leanlm bench serve TARGET --sweep` run, every level in turn: TARGET a model (a leanlm server started
    cold for it, `--serve-args` in args) or a running server's URL."""
    n = max(8, 2 * max(levels))
    cmd = leanlm_command("bench", "serve", target, "--sweep", ",".join(map(str, levels)), "--num-prompts", str(n),
                         "--input-len", "256", "--output-len", "128", "--json", *args)
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return {row["max_concurrency"]: row for row in json.loads(r.stdout)}


def gguf(directory: str) -> Path:
    """A leanlm model directory as one GGUF file (`leanlm export --format gguf`: W8A16 as Q8_0, W4A16 as Q4_1, whose
    float16 offsets round a few groups' zero points by well under 1% of a step: --round-offsets)."""
    path = Path(f"{directory}.gguf")
    if not path.is_file():
        log(f"exporting {directory} -> {path}")
        subprocess.run(leanlm_command("export", directory, "--format", "gguf", "--round-offsets", "-o", str(path)),
                       check=True, stdout=sys.stderr)
    return path


def llama_sweep(model: str, directory: str, levels: list[int]) -> dict[int, dict] | None:
    """llama-server on the directory's GGUF (exported only where llama-server is built; else its hint and None)."""
    server = llama_server(Path(model), gguf(directory) if LLAMA_SERVER.is_file() else None)
    if server is None:
        return None
    with server:
        return sweep(server.url, levels, "--model-name", NAME)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--levels", default="1,4,16,32")
    ap.add_argument("--compile", action="store_true", help="serve every leanlm variant with --compile")
    ap.add_argument("--no-llama", action="store_true", help="leave out llama-server's rows")
    ap.add_argument("--llama-only", action="store_true", help="bf16 and llama-server's rows only (the leanlm "
                                                              "variants' directories made before)")
    ap.add_argument("--variants", default=",".join(label.split()[0] for label in VARIANTS),
                    help="which variants next to bf16, by scheme (W8A16,W8A8,W4A16,W4A8), and `unpacked`: bf16 served "
                         "with --no-pack-weights (torch's GEMM on the plain weights)")
    args = ap.parse_args()
    wanted = args.variants.split(",")
    chosen = {label: qargs for label, qargs in VARIANTS.items() if label.split()[0] in wanted}
    levels = [int(x) for x in args.levels.split(",")]
    serve_args = ("--serve-args", "--compile" if args.compile else "")
    print(f"{args.model}, {'--compile' if args.compile else 'eager'}, 256 in / 128 out, {device_name()}: output tok/s "
          "(median TPOT ms), and against bf16\n")
    print("| variant | " + " | ".join(f"{lv} concurrent" for lv in levels) + " |")
    print("|---|" + "---:|" * len(levels), flush=True)
    base = sweep(args.model, levels, *serve_args)

    def row(label: str, curve: dict[int, dict]) -> None:  # each as it is measured: a later failure loses nothing
        cells = [f"{curve[lv]['output_throughput']:.0f} ({curve[lv]['tpot_ms']['p50']:.1f})" + (
                 "" if curve is base else f", {curve[lv]['output_throughput'] / base[lv]['output_throughput']:.2f}x")
                 for lv in levels]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)

    row("bf16", base)
    if "unpacked" in wanted:
        row("bf16 --no-pack-weights", sweep(args.model, levels, "--serve-args", f"--no-pack-weights {serve_args[1]}"))
    for label, qargs in chosen.items():
        directory = quantized(args.model, label, qargs)
        if not args.llama_only:
            row(label, sweep(directory, levels, *serve_args))
        kind = {"W8A16": "Q8_0", "W4A16": "Q4_1"}.get(label.split()[0])
        if kind and not args.no_llama:
            curve = llama_sweep(str(resolve(args.model)), directory, levels)
            if curve is not None:
                row(f"llama-server {kind} (the {label.split()[0]} weights)", curve)


if __name__ == "__main__":
    main()
