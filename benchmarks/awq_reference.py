"""leanlm's AWQ against the published procedure, both against round-to-nearest, as one table.

    python benchmarks/awq_reference.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--samples 16] [--max-tokens 4096]

"reference" rows re-implement AutoAWQ's steps (https://github.com/casper-hansen/AutoAWQ, quantizer.py) on
transformers' model in float32, independent of leanlm's quantization code: per block, the scales of q/k/v scored
on the attention output and of gate/up on the MLP output (down on its own), alpha in {0, 0.05, ..., 0.95} with
duo scaling; then auto_clip of every projection but q and k; integer zero points, groups of 128 along K (64 where
128 does not divide K, as leanlm's group_for); each block fed the unquantized model's activations. o_proj is not
scaled under grouped-query attention, as in the reference. "leanlm" rows run leanlm's RTN and AWQ (bf16 model,
W4A16 kernel). Same calibration windows, same evaluation tokens and windows. On two cores the reference takes
about 60 s per Qwen2.5-Coder-0.5B block at 16 windows (its scale search runs the attention or MLP 21 times).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from leanlm.models.loading import load
from leanlm import pipeline
from leanlm.compress import registry
from leanlm.eval.datasets import calibration_samples, load_text
from leanlm.eval.perplexity import score, windows
from leanlm.models.zoo import resolve

err = Console(stderr=True)


def group(K: int) -> int:
    return 128 if K % 128 == 0 else 64


def fake_quant(w: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's pseudo_quantize_tensor (4 bits, zero point) over groups of the last dim: rows [..., K] of a
    weight, or [..., g] group-shaped blocks (the clip search)."""
    g = group(w.shape[-1]) if w.dim() == 2 else w.shape[-1]
    wg = w.reshape(-1, g)
    hi, lo = wg.amax(1, keepdim=True), wg.amin(1, keepdim=True)
    s = (hi - lo).clamp(min=1e-5) / 15
    z = (-torch.round(lo / s)).clamp(0, 15)
    return ((torch.clamp(torch.round(wg / s) + z, 0, 15) - z) * s).reshape(w.shape)


def search_scale(fcs, inp, inspect, run) -> torch.Tensor:
    """The scale of the input channels of `fcs` whose rounding gives the least MSE at inspect's output."""
    K = inp.shape[-1]
    W = torch.cat([f.weight for f in fcs]).abs().view(-1, group(K))
    w_mean = (W / (W.amax(1, keepdim=True) + 1e-6)).view(-1, K).mean(0)
    x_mean = inp.abs().reshape(-1, K).mean(0)
    ref = run(inspect, inp)
    original = {k: v.clone() for k, v in inspect.state_dict().items()}
    best, best_s = float("inf"), None
    for i in range(20):
        s = (x_mean.pow(i / 20) / (w_mean.pow(1 - i / 20) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        for f in fcs:
            f.weight.data = fake_quant(f.weight.data * s) / s
        loss = (run(inspect, inp) - ref).pow(2).mean().item()
        if loss < best:
            best, best_s = loss, s
        inspect.load_state_dict(original)
    return best_s


def clip(f, inp: torch.Tensor) -> None:
    """auto_clip: per (row, group), the bound r * max|w|, r in {1, 0.95, ..., 0.55}, with the least error of the
    group's share of the output on 512 evenly spaced tokens (as X_g^T X_g, the same sum)."""
    K = inp.shape[-1]
    g = group(K)
    x = inp.reshape(-1, K)
    x = x[:: max(1, x.shape[0] // 512)].reshape(-1, K // g, g).transpose(0, 1)  # [groups, tokens, g]
    H = x.transpose(1, 2) @ x / x.shape[1]
    w = f.weight.data.reshape(f.weight.shape[0], K // g, g)
    amax = w.abs().amax(-1, keepdim=True)
    bound, least = amax.clone(), torch.full_like(amax, float("inf"))
    for i in range(10):
        b = amax * (1 - i / 20)
        d = fake_quant(torch.clamp(w, -b, b)) - w
        e = torch.einsum("ngi,gij,ngj->ng", d, H, d)[..., None]
        better = e < least
        least, bound = torch.where(better, e, least), torch.where(better, b, bound)
    f.weight.data = torch.clamp(w, -bound, bound).reshape(f.weight.shape)


@torch.no_grad()
def reference_awq(model, samples: torch.Tensor, rtn_only: bool) -> None:
    """Quantize transformers' Qwen2/Llama `model` in place with AutoAWQ's steps (or plain RTN)."""
    x = model.model.embed_tokens(samples)
    pe = model.model.rotary_emb(x, torch.arange(samples.shape[1])[None])

    positional = (type(model.model.layers[0]), type(model.model.layers[0].self_attn))  # they take rope and mask

    def run(module, inp):  # 4 windows at a time
        outs = []
        for i in range(0, inp.shape[0], 4):
            kwargs = {"position_embeddings": pe, "attention_mask": None} if isinstance(module, positional) else {}
            o = module(inp[i:i + 4], **kwargs)
            outs.append(o[0] if isinstance(o, tuple) else o)
        return torch.cat(outs)

    for index, layer in enumerate(model.model.layers):
        start = time.perf_counter()
        a, m = layer.self_attn, layer.mlp
        fcs = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        if not rtn_only:
            feats, hooks = {}, []
            for key, mod in (("qkv", a.q_proj), ("o", a.o_proj), ("gate_up", m.gate_proj), ("down", m.down_proj)):
                hooks.append(mod.register_forward_hook(lambda _m, i, _o, k=key: feats.setdefault(k, []).append(i[0])))
            out = run(layer, x)
            for h in hooks:
                h.remove()
            feats = {k: torch.cat(v) for k, v in feats.items()}
            plan = [(layer.input_layernorm, [a.q_proj, a.k_proj, a.v_proj], "qkv", a),
                    (layer.post_attention_layernorm, [m.gate_proj, m.up_proj], "gate_up", m),
                    (m.up_proj, [m.down_proj], "down", m.down_proj)]
            if a.v_proj.weight.shape == a.o_proj.weight.shape:  # no GQA
                plan.append((a.v_proj, [a.o_proj], "o", a.o_proj))
            scales = [search_scale(fcs_, feats[key], inspect, run) for _, fcs_, key, inspect in plan]
            for (prev, fcs_, key, _), s in zip(plan, scales):
                prev.weight.data /= s if prev.weight.dim() == 1 else s[:, None]
                if getattr(prev, "bias", None) is not None:
                    prev.bias.data /= s
                for f in fcs_:
                    f.weight.data *= s
                feats[key] = feats[key] / s
            for key, f in (("qkv", a.v_proj), ("o", a.o_proj), ("gate_up", m.gate_proj), ("gate_up", m.up_proj),
                           ("down", m.down_proj)):
                clip(f, feats[key])
            x = out
            err.print(f"[dim]reference AWQ block {index}: {time.perf_counter() - start:.0f} s[/]")
        for f in fcs:
            f.weight.data = fake_quant(f.weight.data)


@torch.no_grad()
def hf_perplexity(model, ids: torch.Tensor) -> float:
    nll, count = 0.0, 0
    for begin, end, first in windows(len(ids), 1024, 512):
        logits = model(ids[begin:end][None]).logits[0].float()
        nll += F.cross_entropy(logits[first - begin - 1:end - begin - 1], ids[first:end], reduction="sum").item()
        count += end - first
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--samples", type=int, default=16, help="calibration windows of 512 tokens")
    ap.add_argument("--max-tokens", type=int, default=4096, help="evaluation tokens")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    table = Table(title=f"AWQ W4 g128 against RTN: perplexity on {args.max_tokens} tokens of the built-in evaluation "
                        f"text, calibration {args.samples} x 512")
    for col in ("model", "unquantized (fp32)", "RTN reference", "AWQ reference", "RTN leanlm", "AWQ leanlm"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name in args.models.split(","):
        path = resolve(name)
        leanlm_model, tokenizer = load(name, dtype="bfloat16")
        samples = calibration_samples(tokenizer.encode(load_text(None, split="calibration")), args.samples, 512)
        ids = torch.tensor(tokenizer.encode(load_text(None)))[:args.max_tokens]
        row = []
        for mode in ("none", "rtn", "awq"):
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
            if mode != "none":
                reference_awq(hf, samples, rtn_only=mode == "rtn")
            row.append(hf_perplexity(hf, ids))
        for method in ("rtn", "awq"):
            if method == "awq":
                leanlm_model, _ = load(name, dtype="bfloat16")
            config = pipeline.make_config(method, {"bits": 4, "group_size": 128})
            registry.apply(leanlm_model, config, samples=samples)
            row.append(score(leanlm_model, ids)[0].perplexity)
        table.add_row(name, *(f"{p:.3f}" for p in row))
    Console(width=130).print(table)


if __name__ == "__main__":
    main()
