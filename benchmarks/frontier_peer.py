"""The peers' int4 methods on a model, for benchmarks/frontier.py: the `auto-round` package's AutoRound, the `hqq`
package's HQQ and llm-compressor's GPTQ (alone, or after its SpinQuantModifier's offline R1 and R2 rotations), each
in its own virtual environment (the script imports only the method's package, transformers, safetensors and torch;
llm-compressor pins an older auto-round than the one measured).

    python frontier_peer.py MODEL_DIR OUT_DIR --method autoround|hqq|gptq|spinquant-gptq
                            [--calibration CALIBRATION.safetensors]
                            [--group-size 128] [--sym] [--iters N] [--threads 2]

CALIBRATION.safetensors holds `input_ids` [n, T] int64: the windows leanlm calibrates on, so both sides see the
same tokens (HQQ needs no data). Each projection of the decoder gets int4 groups along K (the
requested size, or 64 where it does not divide K, as leanlm does), and its weight is written back dequantized: OUT_DIR
is a plain HF directory (bf16 safetensors and the source's config and tokenizer files; the config written anew
where a rotation untied the lm_head) that leanlm scores itself.
One JSON line on stdout: {"seconds": time of the method alone, "peak_mb": peak RSS}.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def group_for(K: int, group_size: int) -> int:
    return group_size if K % group_size == 0 else 64


def run_hqq(model, args) -> None:
    from hqq.core.quantize import Quantizer

    for name, module in model.named_modules():
        if name.endswith(PROJECTIONS):
            W = module.weight.detach().float()
            g = group_for(W.shape[1], args.group_size)
            q, meta = Quantizer.quantize(W, nbits=4, group_size=g, axis=1, optimize=args.iters > 0, device="cpu",
                                         bitpack=False, compute_dtype=torch.float32)
            module.weight.data = Quantizer.dequantize(q, meta).reshape(W.shape).to(module.weight.dtype)


def run_autoround(model, tokenizer, args) -> None:
    from auto_round import AutoRound

    ids = load_file(str(args.calibration))["input_ids"]
    batches = [ids[i:i + 8] for i in range(0, len(ids), 8)]
    layers = {}
    for name, module in model.named_modules():
        if name.endswith(PROJECTIONS) and module.in_features % args.group_size:
            layers[name] = {"bits": 4, "group_size": 64, "sym": args.sym}
    ar = AutoRound(model, tokenizer, bits=4, group_size=args.group_size, sym=args.sym, iters=args.iters,
                   nsamples=len(ids), seqlen=ids.shape[1], batch_size=8, dataset=batches, device_map="cpu",
                   layer_config=layers or None)
    ar.quantize()  # leaves each tuned projection's weight fake-quantized (its qdq values) in the model


def run_gptq(model, args) -> None:
    """llm-compressor's GPTQModifier at its defaults (block 128, dampening 0.01), sequential pipeline; for
    spinquant-gptq after SpinQuantModifier's R1 (residual stream) and R2 (values per head) rotations, which it folds
    into the weights: random Hadamard matrices (its deterministic "hadamard" type has powers of two only, and
    SmolLM2's hidden size is 576)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform import SpinQuantModifier

    ids = load_file(str(args.calibration))["input_ids"]
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    by_group = {}
    for name, module in model.named_modules():
        if name.endswith(PROJECTIONS):
            by_group.setdefault(group_for(module.in_features, args.group_size), []).append(name)
    groups = {f"group_{g}": {"targets": names, "weights": {"num_bits": 4, "type": "int", "symmetric": args.sym,
                                                            "strategy": "group", "group_size": g}}
              for g, names in by_group.items()}
    recipe = [GPTQModifier(config_groups=groups, ignore=["lm_head"])]
    if args.method == "spinquant-gptq":
        recipe.insert(0, SpinQuantModifier(rotations=["R1", "R2"], transform_type="random-hadamard"))
    oneshot(model=model, recipe=recipe, dataset=data,
            num_calibration_samples=len(ids), max_seq_length=ids.shape[1], shuffle_calibration_samples=False,
            batch_size=8, pipeline="sequential")  # leaves each projection's weight on its grid, dequantized


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("output", type=Path)
    ap.add_argument("--method", choices=("autoround", "hqq", "gptq", "spinquant-gptq"), required=True)
    ap.add_argument("--calibration", type=Path)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--sym", action="store_true")
    ap.add_argument("--iters", type=int, default=None, help="autoround: 200; hqq: its solver (0: min-max only)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.iters = args.iters if args.iters is not None else (200 if args.method == "autoround" else 20)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    start = time.perf_counter()
    if args.method == "autoround":
        run_autoround(model, tokenizer, args)
    elif args.method == "hqq":
        run_hqq(model, args)
    else:
        run_gptq(model, args)
    seconds = time.perf_counter() - start

    args.output.mkdir(parents=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if k.endswith((".weight", ".bias"))}  # not llm-compressor's weight_scale / weight_zero_point
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if tied:
        state.pop("lm_head.weight", None)
    save_file(state, str(args.output / "model.safetensors"), metadata={"format": "pt"})
    for f in args.model.iterdir():
        if f.suffix != ".safetensors" and f.is_file() and not f.name.startswith("model.safetensors"):
            shutil.copy(f, args.output / f.name)
    if not tied:  # a rotation gave the lm_head its own weights
        config = json.loads((args.output / "config.json").read_text())
        (args.output / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    print(json.dumps({"seconds": seconds, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
