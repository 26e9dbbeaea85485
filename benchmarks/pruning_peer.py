"""llm-compressor's one-shot SparseGPT or Wanda on a model, for benchmarks/pruning.py (runs in llm-compressor's
own virtual environment: it imports only llmcompressor, transformers, datasets, safetensors and torch).

    python pruning_peer.py MODEL_DIR CALIBRATION.safetensors OUT_DIR --method sparsegpt|wanda
                           [--sparsity 0.5 | --pattern 2:4] [--threads 2]

CALIBRATION.safetensors holds `input_ids` [n, T] int64: the calibration windows leanlm used, so both sides see
the same tokens. The pruned model is written to OUT_DIR as a plain HF directory (dense bf16 safetensors, the
source's config and tokenizer files), which leanlm loads and scores itself. One JSON line on stdout:
{"seconds": time inside oneshot(), "sparsity": fraction of zeros in the pruned projections, "peak_mb": peak RSS}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.pruning import SparseGPTModifier, WandaPruningModifier
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("calibration", type=Path)
    ap.add_argument("output", type=Path)
    ap.add_argument("--method", choices=("sparsegpt", "wanda"), required=True)
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--pattern", default="0:0", help="N:M mask structure (0:0: unstructured)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    ids = load_file(str(args.calibration))["input_ids"]  # [n, T]
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    # The settings leanlm uses too: the same sparsity or N:M, every decoder Linear (lm_head left dense); SparseGPT
    # with block 128 and dampening 0.01 of the mean Hessian diagonal (llm-compressor's defaults, as leanlm's).
    common = dict(sparsity=args.sparsity, mask_structure=args.pattern, targets=["Linear"], ignore=["re:.*lm_head"])
    modifier = (SparseGPTModifier(block_size=128, dampening_frac=0.01, **common) if args.method == "sparsegpt"
                else WandaPruningModifier(**common))
    start = time.perf_counter()
    oneshot(model=model, recipe=modifier, dataset=data, num_calibration_samples=len(ids),
            max_seq_length=ids.shape[1], shuffle_calibration_samples=False, batch_size=8, pipeline="sequential")
    seconds = time.perf_counter() - start

    args.output.mkdir(parents=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one tensor with the embedding; safetensors stores it once
    save_file(state, str(args.output / "model.safetensors"), metadata={"format": "pt"})
    for f in args.model.iterdir():
        if f.name == "config.json" or f.name.startswith("tokenizer"):
            shutil.copy2(f, args.output / f.name)
    layers = [v for k, v in state.items() if k.startswith("model.layers.") and k.endswith("proj.weight")]
    zeros = sum(int((w == 0).sum()) for w in layers) / sum(w.numel() for w in layers)
    status = Path("/proc/self/status").read_text()  # peak RSS since exec (ru_maxrss would carry the parent's)
    peak_mb = int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024
    print(json.dumps({"seconds": seconds, "sparsity": zeros, "peak_mb": peak_mb}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
