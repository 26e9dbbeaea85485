"""analysis.roofline: per-op counts equal the textbook formulas written out by hand, and equal what
torch.utils.flop_counter counts on the same forward of a tiny Transformer (prefill and a cached decode step);
`leanlm analyze` as a user runs it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from leanlm.analysis import roofline as rl
from leanlm.errors import LeanLMError
from leanlm.models.config import ModelConfig
from leanlm.models.transformer import Transformer
from tests.test_cli import leanlm

# d=64, I=96, L=2, H=4 query heads, Hkv=2 KV heads (GQA), D=16, V=128: q = 64, kv = 32
CFG = ModelConfig("llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position=64)
B, T = 2, 8


def _by_op(costs):
    return {c.op: (c.flops, c.bytes) for c in costs}


def test_prefill_counts_equal_the_formulas_written_out():
    """2 B/weight, 2 B/activation, 2 B/cached value; causal attention: T(T+1)/2 = 36 query-key pairs per head."""
    got = _by_op(rl.op_costs(CFG, "prefill", B, T))
    L, BT = 2, B * T
    assert got["qkv_proj"] == (L * 2 * BT * 64 * 128, L * (64 * 128 * 2 + BT * (64 + 128) * 2))
    assert got["o_proj"] == (L * 2 * BT * 64 * 64, L * (64 * 64 * 2 + BT * (64 + 64) * 2))
    attn = (L * 2 * B * 4 * 36 * 16, L * (B * 4 * T * 16 * 2 + B * 2 * T * 16 * 2))  # Q (or O) + K (or V), 2 KV heads
    assert got["qk"] == attn and got["pv"] == attn
    assert got["gate_up_proj"] == (L * 2 * BT * 64 * 192, L * (64 * 192 * 2 + BT * (64 + 192) * 2))
    assert got["down_proj"] == (L * 2 * BT * 96 * 64, L * (96 * 64 * 2 + BT * (96 + 64) * 2))
    assert got["lm_head"] == (2 * B * 64 * 128, 64 * 128 * 2 + B * (64 + 128) * 2)  # last position only
    full = _by_op(rl.op_costs(CFG, "prefill", B, T, causal=False, logits_all=True))
    assert full["qk"][0] == L * 2 * B * 4 * T * T * 16 and full["qk"][1] == attn[1]
    assert full["lm_head"] == (2 * BT * 64 * 128, 64 * 128 * 2 + BT * (64 + 128) * 2)


def test_decode_counts_equal_the_formulas_written_out():
    """One token per sequence at context S = 8: S pairs per head; weights read whole whatever the batch."""
    S, L = 8, 2
    got = _by_op(rl.op_costs(CFG, "decode", B, S, act_bytes=2, weight_bytes=1, kv_bytes=1))
    assert got["qkv_proj"] == (L * 2 * B * 64 * 128, L * (64 * 128 * 1 + B * (64 + 128) * 2))
    attn = (L * 2 * B * 4 * S * 16, L * (B * 4 * 16 * 2 + B * 2 * S * 16 * 1))
    assert got["qk"] == attn and got["pv"] == attn
    assert got["down_proj"] == (L * 2 * B * 96 * 64, L * (96 * 64 * 1 + B * (96 + 64) * 2))
    assert got["lm_head"] == (2 * B * 64 * 128, 64 * 128 * 1 + B * (64 + 128) * 2)
    assert set(got) == set(rl.OPS)
    with pytest.raises(LeanLMError, match="phase"):
        rl.op_costs(CFG, "train", B, S)


def test_gqa_reads_fewer_kv_bytes_than_mha_for_the_same_flops():
    mha = replace(CFG, num_kv_heads=4)
    gqa, full = _by_op(rl.op_costs(CFG, "decode", 1, 32)), _by_op(rl.op_costs(mha, "decode", 1, 32))
    assert gqa["qk"][0] == full["qk"][0]
    assert full["qk"][1] - gqa["qk"][1] == 2 * 1 * (4 - 2) * 32 * 16 * 2  # L x B x (H - Hkv) x S x D x 2 B
    assert full["qk"][0] / full["qk"][1] < gqa["qk"][0] / gqa["qk"][1]


CONFIGS = {
    "gqa": CFG,
    "mha, qkv bias, untied": replace(CFG, num_kv_heads=4, qkv_bias=True),
    "tied, one layer": replace(CFG, num_layers=1, tie_embeddings=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_formulas_agree_with_flop_counter_on_the_same_forward(name):
    """flop_counter counts matmuls (mm/addmm/bmm: a bias add is not counted, nor are norms, RoPE, softmax) and SDPA
    as the full T x S square whatever the mask; the CPU flash kernel leanlm's prefill runs is counted with that
    same formula (roofline._cpu_sdpa_flops). So the formulas with causal=False equal it op by op; the causal count
    the tables show is (T+1)/(2T) of its attention. Decode (one query, S keys) has no such difference."""
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    for phase, seq, logits_all in (("prefill", T, False), ("prefill", T, True), ("decode", 12, False)):
        counted = rl.counted_flops(model, phase, B, seq, logits_all=logits_all)
        costs = rl.op_costs(cfg, phase, B, seq, causal=False, logits_all=logits_all)
        assert counted == rl.formula_by_counted_op(costs), (phase, logits_all)
        assert counted["attention"] > 0 and sum(counted.values()) == rl.total(costs)[0]
        assert rl.counted_flops(rl.meta_transformer(cfg), phase, B, seq, logits_all) == counted  # no weights needed
    causal = rl.formula_by_counted_op(rl.op_costs(cfg, "prefill", B, T))
    assert causal["attention"] * 2 * T == rl.counted_flops(model, "prefill", B, T)["attention"] * (T + 1)


def test_ridge_and_the_batch_where_decode_turns_compute_bound():
    assert rl.ridge_point(300.0, 30.0) == 10.0
    assert rl.attainable_gflops(2.0, 300.0, 30.0) == 60.0 and rl.attainable_gflops(50.0, 300.0, 30.0) == 300.0

    def intensity(b, op=None):
        flops, nbytes = rl.total([c for c in rl.op_costs(CFG, "decode", b, 4) if op is None or c.op == op])
        return flops / nbytes

    for op, ridge in ((None, 5.0), ("down_proj", 10.0), ("lm_head", 3.0)):
        b = rl.decode_compute_bound_batch(CFG, 4, ridge, op)
        assert b is not None and intensity(b, op) >= ridge and (b == 1 or intensity(b - 1, op) < ridge)
    # attention's intensity does not grow with batch (each sequence reads its own cache): never, or from batch 1
    assert rl.decode_compute_bound_batch(CFG, 4, 5.0, "qk") is None
    assert rl.decode_compute_bound_batch(CFG, 4, intensity(1, "qk") * 0.99, "qk") == 1
    assert rl.decode_compute_bound_batch(CFG, 4, 1e6) is None


class FakeInt8(nn.Module):
    """Stores what W8A16Linear stores (int8 codes [N, K], a bf16 scale per row), without its kernels."""

    def __init__(self, k: int, n: int):
        super().__init__()
        self.in_features, self.out_features = k, n
        self.register_buffer("weight", torch.zeros(n, k, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(n, dtype=torch.bfloat16))
        self.register_buffer("bias", None)


def test_weight_bytes_per_element_reads_what_each_projection_stores():
    model = Transformer(CFG).to(torch.bfloat16)
    assert rl.weight_bytes_per_element(model) == {p: 2.0 for p in rl.PROJECTIONS}
    for layer in model.layers:
        layer.self_attn.o_proj = FakeInt8(64, 64)
    per = rl.weight_bytes_per_element(model)
    assert per["o_proj"] == (64 * 64 + 64 * 2) / (64 * 64) and per["down_proj"] == 2.0
    base, quant = (_by_op(rl.op_costs(CFG, "decode", 1, 8, weight_bytes=w)) for w in (2.0, per))
    assert base["o_proj"][1] - quant["o_proj"][1] == 2 * (64 * 64 * 2 - (64 * 64 + 64 * 2))
    assert {k: v for k, v in base.items() if k != "o_proj"} == {k: v for k, v in quant.items() if k != "o_proj"}


def test_memory_rows_formulas_next_to_measured(tiny):
    model = tiny[0]
    cfg = model.config
    rows = {r.quantity.split(" (")[0].split(",")[0]: r for r in rl.memory_rows(model, 2, 16)}
    for name in ("parameters", "weights", "input ids", "output logits"):
        assert rows[name].by_formula == rows[name].measured, name
    kv = rows["KV cache 2 x 16"]
    assert kv.by_formula == kv.measured == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 2 * 16
    assert rows["KV cache if MHA"].by_formula == kv.by_formula * cfg.num_heads / cfg.num_kv_heads
    assert rows["activations"].measured > 0


def test_roofline_plot_is_a_png(tmp_path):
    costs = rl.op_costs(CFG, "prefill", B, T) + rl.op_costs(CFG, "decode", B, T)
    rl.plot_roofline(costs, 300.0, 30.0, tmp_path / "r.png", "tiny")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quadratic_fit_and_a_tiny_hidden_sweep():
    a, b, c = rl.fit_quadratic([1, 2, 3, 5], [3 * x * x - 2 * x + 7 for x in (1, 2, 3, 5)])
    assert (a, b, c) == pytest.approx((3, -2, 7))
    with pytest.raises(LeanLMError, match="3 distinct"):
        rl.fit_quadratic([1, 1, 2], [1, 1, 2])
    assert rl.sweep_shapes(8) == {"qkv": (8, 24), "out": (8, 8), "ff1": (8, 32), "ff2": (32, 8)}
    times = rl.sweep_hidden([8, 16, 24], tokens=2, reps=1)
    assert set(times) == set(rl.SWEEP_OPS) and all(len(t) == 3 and min(t) > 0 for t in times.values())
    assert len(rl.fit_quadratic([8, 16, 24], times["ff1"])) == 3


def test_analyze_cli(tiny_dir, tmp_path):
    plot = tmp_path / "roof.png"
    r = leanlm("analyze", tiny_dir, "--seq-len", "16", "--batch", "2", "--json", "--bandwidth", "30", "--gflops", "300",
               "--threads", "1", "--dtype", "float32", "--plot", plot)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["ridge"] == 10.0 and plot.read_bytes()[:4] == b"\x89PNG"
    for phase in ("prefill", "decode"):
        assert [c["op"] for c in report[phase]] == list(rl.OPS)
        assert report["totals"][phase]["flops"] == sum(c["flops"] for c in report[phase])
        assert report["flop_check"][phase]["formula"] == report["flop_check"][phase]["flop_counter"]
    assert set(report["decode_compute_bound_batch"]) == {*rl.OPS, "total"}
    assert {m["quantity"] for m in report["memory"]} >= {"parameters", "weights", "input ids"}


@pytest.mark.parametrize("args,message", [
    (["--seq-len", "1000", "--dtype", "float32"], "context window (256)"),
    (["--sweep-hidden", "--hidden-sizes", "64,x"], "--hidden-sizes must be at least 3 distinct"),
    (["--plot", "roof.svg"], "ending in .png"),
])
def test_analyze_cli_bad_input_is_one_line(tiny_dir, args, message):
    from typer.testing import CliRunner

    import leanlm.cli  # noqa: F401  (registers the verbs)
    from leanlm.cli.common import app

    r = CliRunner().invoke(app, ["analyze", str(tiny_dir), *args])
    assert r.exit_code == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1
