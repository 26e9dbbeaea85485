"""The compression frontier at 4 bits: every leanlm int4 method next to the peers' on the same windows and text.

    python benchmarks/frontier.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--samples 128] [--seq-len 512]
                                  [--iters 50] [--max-tokens 16384] [--no-peer | --peers auto-round,hqq,...]
                                  [--grids both|asymmetric|symmetric]
                                  [--methods gptq,awq,hqq,autoround,rotate+gptq,rotate+autoround,gptq+distill,...]
                                  [--distill-steps 100]

Calibration: --samples windows of --seq-len tokens of the built-in calibration split (seed 0, the windows
`leanlm quantize` takes), written once to a safetensors file that leanlm and the peers read. Evaluation: leanlm's
perplexity on the first --max-tokens of the evaluation split (windows 1024, stride 512, bf16), KL and top-1
agreement to the bf16 model, in one process for every row (the peers' models are written back dequantized, so the
same code scores them). Every decoder projection gets int4 groups of 128 along K (64 where 128 does not divide K,
on both sides); embeddings and lm_head stay bf16. Asymmetric (zero points) and, where a tool has it, symmetric.
AutoRound runs --iters steps per block on both sides (the package's default is 200; 50 keeps the run near an hour).
"rotate+M" is the recipe `- method: rotate` then M: QuaRot's offline Hadamard rotations folded into the weights
first (a tied lm_head is untied: vocab x hidden more bf16 weights, outside the projections' bits). "M+distill" is
M then `- {method: distill, steps: --distill-steps}`, EfficientQAT's end-to-end step: the codes stay, each group's
scale and mid and the norms learn the bf16 model's distributions on the calibration split (batches of 4 x 256
tokens; never the evaluation text), run on M's cached model; its "s" is both steps'. Peers, each in
its own virtual environment (benchmarks/frontier_peer.py): `auto-round` 0.16.1 and `hqq` 0.2.8 (--frontier-python),
llm-compressor 0.14 GPTQ, alone and after its SpinQuantModifier's R1 and R2 rotations (--llmc-python). Every
variant is made in a fresh process ("s" is the method alone, loading and saving left out; "peak MB" its own peak
RSS) and cached under $LEANLM_CACHE/bench-frontier/ with its measurements (delete that folder to re-measure).
Bits per weight are the decoder projections' stored bits over their weights: leanlm's as its modules hold them
(bf16 scale and offset per group), the peers' by their formats (fp16 scale, and zero point where asymmetric).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pruning import distill_child, measured, quantize_child, wait_quiet, write_calibration  # shared

err = Console(stderr=True)
FRONTIER_PYTHON = "/work/venvs/frontier/bin/python"  # auto-round 0.16.1, hqq 0.2.8
LLMC_PYTHON = "/work/venvs/llmc/bin/python"  # llmcompressor 0.14.0
# (label, method, options); group_size 128 for all; "rotate+M": the rotate step, then M with the options
LEANLM = [("RTN", "rtn", {"bits": 4}), ("RTN", "rtn", {"bits": 4, "symmetric": True}),
          ("GPTQ", "gptq", {}), ("GPTQ", "gptq", {"symmetric": True}), ("AWQ", "awq", {}),
          ("HQQ", "hqq", {}), ("AutoRound", "autoround", {}), ("AutoRound", "autoround", {"symmetric": True}),
          ("rotation + GPTQ", "rotate+gptq", {}), ("rotation + AutoRound", "rotate+autoround", {}),
          ("GPTQ + distillation", "gptq+distill", {}), ("AutoRound + distillation", "autoround+distill", {}),
          ("rotation + GPTQ + distillation", "rotate+gptq+distill", {})]
PEERS = [("auto-round", "autoround", False), ("auto-round", "autoround", True), ("hqq", "hqq", False),
         ("llm-compressor", "gptq", False), ("llm-compressor", "gptq", True),
         ("llm-compressor", "spinquant+gptq", False)]
PEER_LABELS = {"autoround": "AutoRound", "hqq": "HQQ", "gptq": "GPTQ", "spinquant+gptq": "SpinQuant R1 R2 + GPTQ"}


def projection_bits(path: Path) -> float:
    """Stored bits per weight of a leanlm directory's decoder projections (codes, scales, offsets)."""
    from leanlm.compress.registry import decoder_linears
    from leanlm.models.loading import load_model

    net = load_model(path, "bfloat16")
    stored = weights = 0
    for _, m in net.named_modules():
        if getattr(m, "SCHEME", None) == "w4a16":
            stored += sum(b.nbytes for n, b in m.named_buffers() if n != "bias") * 8
            weights += m.in_features * m.out_features
    assert weights and not list(decoder_linears(net)), f"{path}: a projection is not int4"
    return stored / weights


def format_bits(model: str, group_size: int, zero_point: bool) -> float:
    """Bits per weight of int4 groups with an fp16 scale (and an fp16 zero point) per group, over the model's
    decoder projections, each with the group size the benchmark gives it."""
    from leanlm.compress.quant.rtn import group_for
    from leanlm.models.config import ModelConfig
    from leanlm.models.zoo import resolve

    cfg = ModelConfig.from_dir(resolve(model, progress=False))
    d, i, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = [(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * h), (cfg.num_heads * h, d), (d, 2 * i), (i, d)]  # (K, N)
    bits = sum(K * N * (4 + 16 * (1 + zero_point) / group_for(K, group_size)) for K, N in shapes)
    return bits / sum(K * N for K, N in shapes)


class Frontier:
    def __init__(self, model: str, args):
        from leanlm.fetch import cache_dir

        self.model, self.args = model, args
        self.root = cache_dir() / "bench-frontier" / model / f"n{args.samples}x{args.seq_len}"
        self.calibration = self.root / "calibration.safetensors"
        write_calibration(model, args.samples, args.seq_len, self.calibration)

    def leanlm(self, method: str, options: dict) -> tuple[Path, dict]:
        if method.endswith("+distill"):  # the distill step on the cached model of the steps before it
            source, cost = self.leanlm(method.removesuffix("+distill"), options)
            out = source.with_name(f"{source.name}+distill-steps{self.args.distill_steps}")
            err.print(f"[dim]{self.model}: leanlm {out.name}[/]")
            tuned = measured([sys.executable, str(Path(__file__).resolve()), "--distill-child", self.model,
                              str(source), str(self.args.distill_steps), str(out)], out)
            both = {"seconds": cost["seconds"] + tuned["seconds"], "peak_mb": max(cost["peak_mb"], tuned["peak_mb"])}
            return out, both
        tuned = method.split("+")[-1] == "autoround"
        options = {"group_size": 128, **options, **({"iters": self.args.iters} if tuned else {})}
        tag = "-".join([method, *(f"{k}{v}" for k, v in sorted(options.items()))])
        out = self.root / tag
        err.print(f"[dim]{self.model}: leanlm {tag}[/]")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", self.model, method, json.dumps(options),
               str(self.calibration), str(out), "--threads", str(self.args.threads)]
        return out, measured(cmd, out)

    def peer(self, method: str, symmetric: bool) -> tuple[Path, dict]:
        from leanlm.models.zoo import resolve

        python = self.args.llmc_python if method.endswith("gptq") else self.args.frontier_python
        tag = f"peer-{method}{'-sym' if symmetric else ''}" + (f"-iters{self.args.iters}" if method == "autoround"
                                                               else "")
        method = method.replace("+", "-")  # frontier_peer.py's --method
        out = self.root / tag
        err.print(f"[dim]{self.model}: peer {tag}[/]")
        cmd = [python, "-P", str(Path(__file__).with_name("frontier_peer.py")), str(resolve(self.model)), str(out),
               "--method", method, "--calibration", str(self.calibration), "--group-size", "128",
               "--threads", str(self.args.threads), *(["--sym"] if symmetric else []),
               *(["--iters", str(self.args.iters)] if method == "autoround" else [])]
        return out, measured(cmd, out)

    def quality(self, dirs: list[Path]) -> list:
        """Rows of leanlm.bench.compare.quality for the bf16 model and each directory, kept beside each model."""
        from leanlm.bench.compare import Compared, quality

        records = [self.root / f"{name}.quality{self.args.max_tokens}.json" for name in ["bf16", *(d.name for d in
                                                                                                   dirs)]]
        todo = [(d, r) for d, r in zip(dirs, records[1:]) if not r.exists()]
        if todo or not records[0].exists():  # the bf16 row is scored again with the new ones: KL needs its logits
            wait_quiet()
            rows = quality(self.model, [str(d) for d, _ in todo], "bfloat16", "cpu", self.args.max_tokens)
            for record, row in zip([records[0], *(r for _, r in todo)], rows):
                record.write_text(json.dumps(row.to_dict()))
        return [Compared(**json.loads(r.read_text())) for r in records]


def table(model: str, args) -> Table:
    f = Frontier(model, args)
    grids = {"both": (False, True), "asymmetric": (False,), "symmetric": (True,)}[args.grids]
    methods = {"rtn", *args.methods.split(",")}  # RTN always: the table divides each gap by its
    runs = [("leanlm", label, bool(opts.get("symmetric")), *f.leanlm(method, opts)) for label, method, opts in LEANLM
            if bool(opts.get("symmetric")) in grids and method in methods]
    if not args.no_peer:
        runs += [(tool, label, sym, *f.peer(method, sym)) for tool, method, sym in PEERS
                 if sym in grids and {tool, method} & set(args.peers.split(","))
                 for label in [PEER_LABELS[method]]]
    base, *rows = f.quality([r[3] for r in runs])
    rtn_gap = {sym: row.perplexity - base.perplexity for (tool, label, sym, *_), row in zip(runs, rows)
               if tool == "leanlm" and label == "RTN"}
    t = Table(title=f"{model}: int4 groups of 128 (64 where K needs), {args.max_tokens} evaluation tokens, "
                    f"calibration {args.samples} x {args.seq_len}, AutoRound {args.iters} steps; bf16 perplexity "
                    f"{base.perplexity:.3f}")
    for col in ("tool", "method", "grid", "bits/weight", "perplexity", "gap", "gap / RTN's", "KL", "top-1", "s",
                "peak MB"):
        t.add_column(col, justify="left" if col in ("tool", "method", "grid") else "right")
    best = min(r.perplexity for r in rows)
    for (tool, label, sym, path, cost), row in zip(runs, rows):
        bits = projection_bits(path) if tool == "leanlm" else format_bits(model, 128, zero_point=not sym)
        gap = row.perplexity - base.perplexity
        ppl = f"{row.perplexity:.3f}"
        t.add_row(tool, label, "symmetric" if sym else "asymmetric", f"{bits:.2f}",
                  f"[bold]{ppl}[/]" if row.perplexity == best else ppl, f"{gap / base.perplexity:+.2%}",
                  f"{gap / rtn_gap[sym]:.2f}", f"{row.kl:.4f}", f"{row.top1:.1%}", f"{cost['seconds']:.1f}",
                  f"{cost['peak_mb']:.0f}")
    return t


def main() -> None:
    if sys.argv[1:2] == ["--distill-child"]:
        model, source, steps, output = sys.argv[2:]
        return distill_child(model, source, int(steps), output)
    if sys.argv[1:2] == ["--child"]:
        ap = argparse.ArgumentParser()
        ap.add_argument("model")
        ap.add_argument("method")
        ap.add_argument("options")
        ap.add_argument("calibration")
        ap.add_argument("output")
        ap.add_argument("--threads", type=int, default=2)
        a = ap.parse_args(sys.argv[2:])
        return quantize_child(a.model, a.method, json.loads(a.options), a.calibration, a.output, a.threads)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--samples", type=int, default=128, help="calibration windows")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    ap.add_argument("--iters", type=int, default=50, help="AutoRound steps per block, both sides")
    ap.add_argument("--max-tokens", type=int, default=16384, help="evaluation tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frontier-python", default=FRONTIER_PYTHON, help="python with auto-round 0.16.1 and hqq 0.2.8")
    ap.add_argument("--llmc-python", default=LLMC_PYTHON, help="python with llmcompressor 0.14")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peers", default="auto-round,hqq,llm-compressor",
                    help="which peers to run: tools, or methods (gptq, spinquant+gptq, ...)")
    ap.add_argument("--methods", default=",".join(dict.fromkeys(m for _, m, _ in LEANLM if m != "rtn")),
                    help="leanlm's methods to make besides RTN (which every table has); rotate+M rotates first, "
                         "M+distill distils after")
    ap.add_argument("--distill-steps", type=int, default=100,
                    help="steps of the distill step after the +distill methods (batches of 4 x 256 tokens)")
    ap.add_argument("--grids", choices=["both", "asymmetric", "symmetric"], default="both",
                    help="which int4 grids to make (asymmetric alone: half the variants)")
    args = ap.parse_args()
    for option, names, known in (("--methods", args.methods, {method for _, method, _ in LEANLM}),
                                 ("--peers", args.peers, {tool for tool, _, _ in PEERS} | set(PEER_LABELS))):
        if unknown := set(names.split(",")) - known:
            ap.error(f"{option}: unknown {', '.join(sorted(unknown))}")
    out = Console(width=170)
    for model in args.models.split(","):
        out.print(table(model, args))


if __name__ == "__main__":
    main()
