"""SmoothQuant: the smoothing is an exact rewrite, it lowers W8A8 error under outlier channels, and the
smoothed-then-quantized model saves and loads to the same logits."""

import json

import pytest
import torch
from torch import nn

from leanlm.compress.quant import format as qformat
from leanlm.compress.quant.smoothquant import (ALPHAS, SmoothQuant, SmoothStats, fold, search_alpha, smooth,
                                               smoothing_scale)
from leanlm.compress.registry import apply, decoder_linears
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W8A8Linear
from leanlm.lowbit.primitives import sqnr_db
from leanlm.lowbit.record import RECORD
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model

SAMPLES = torch.randint(3, 128, (6, 24), generator=torch.Generator().manual_seed(0))
TOKENS = torch.randint(3, 128, (2, 13), generator=torch.Generator().manual_seed(1))
POSITIONS = torch.arange(13)[None].expand(2, -1)


def test_smoothing_scale_formula():
    act = torch.tensor([4.0, 1.0, 0.0, 9.0])  # [K]; channel 2 never fired
    w = torch.tensor([[0.5, -2.0, 0.0, 1.0], [-1.0, 0.5, 0.0, 0.25]])  # [N, K]; column 2 is all zero
    s = smoothing_scale(act, w, 0.5)
    assert torch.allclose(s[[0, 1, 3]], torch.tensor([2.0, 1 / 2**0.5, 3.0]))
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.allclose(smoothing_scale(act, w, 1.0)[[0, 1, 3]], act[[0, 1, 3]])  # all difficulty to the weights
    assert torch.allclose(smoothing_scale(act, w, 0.0)[[0, 1, 3]], 1 / torch.tensor([1.0, 2.0, 1.0]))


def test_fold_is_exact_for_a_norm_then_linear():
    g = torch.Generator().manual_seed(0)
    x, norm_w, w = torch.randn(5, 8, generator=g), torch.rand(8, generator=g) + 0.5, torch.randn(3, 8, generator=g)
    s = torch.rand(8, generator=g) * 10 + 0.1
    new_norm, new_w = fold(norm_w, w, s)
    torch.testing.assert_close((x * new_norm) @ new_w.T, (x * norm_w) @ w.T)
    rows, down = torch.randn(8, 4, generator=g), torch.randn(6, 8, generator=g)  # up rows [I, d], down [d', I]
    new_rows, new_down = fold(rows, down, s)
    torch.testing.assert_close((x[:, :4] @ new_rows.T) @ new_down.T, (x[:, :4] @ rows.T) @ down.T)


@pytest.mark.parametrize("alpha", [0.5, None])
@pytest.mark.parametrize("smooth_down", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_smoothing_alone_leaves_the_float_model_unchanged(tmp_path, arch, smooth_down, alpha):
    make_hf_model(arch, tmp_path)
    model = load_model(tmp_path, torch.float32)
    expected = model(TOKENS, POSITIONS)
    norm_before = model.layers[0].input_layernorm.weight.clone()
    alphas = smooth(model, SAMPLES, alpha=alpha, smooth_down=smooth_down)
    projections = ["self_attn.qkv_proj", "mlp.gate_up_proj"] + (["mlp.down_proj"] if smooth_down else [])
    assert set(alphas) == {f"layers.{i}.{p}" for i in range(len(model.layers)) for p in projections}
    assert all(a == alpha for a in alphas.values()) if alpha is not None else set(alphas.values()) <= {None, *ALPHAS}
    if alphas["layers.0.self_attn.qkv_proj"] is not None:
        assert not torch.allclose(model.layers[0].input_layernorm.weight, norm_before)  # it did rescale
    torch.testing.assert_close(model(TOKENS, POSITIONS), expected, rtol=1e-4, atol=1e-4)


def test_smoothing_beats_plain_w8a8_on_outlier_channels():
    g = torch.Generator().manual_seed(0)
    K, N = 256, 128
    x = torch.randn(64, K, generator=g)  # [M, K]
    x[:, [5, 77, 200]] *= 60  # systematic outlier channels, as in LLM activations
    lin = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=g) * 0.05)
    expected = x @ lin.weight.T
    plain = W8A8Linear.from_float(lin)(x)
    s = smoothing_scale(x.abs().amax(0), lin.weight, alpha=0.5)
    inv, w_s = fold(torch.ones(K), lin.weight, s)  # the producer would output x / s
    with torch.no_grad():
        lin.weight.copy_(w_s)
    smoothed = W8A8Linear.from_float(lin)(x * inv)
    assert sqnr_db(expected, smoothed) > sqnr_db(expected, plain) + 6


def test_stats_keep_a_random_share_of_the_rows():
    x = torch.arange(4 * 64 * 8, dtype=torch.float32).reshape(4, 64, 8)  # 4 windows of 64 positions, distinct rows
    stats = SmoothStats(8, keep_every=16)
    for batch in x.split(2):
        stats.add_batch(batch)
    kept = torch.cat(stats.kept)
    assert kept.shape == (16, 8)
    rows = {tuple(r) for r in x.reshape(-1, 8).tolist()}
    assert all(tuple(r) in rows for r in kept.tolist()) and len({tuple(r) for r in kept.tolist()}) == 16
    positions = (kept[:, 0] / 8).long() % 64
    assert len(set(positions.tolist())) > 4  # not one stride-aligned set of positions in every window
    torch.testing.assert_close(stats.value, x.reshape(-1, 8).abs().amax(0))


def test_searched_alpha_has_the_least_w8a8_error_of_its_candidates():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g)
    x[:, [3, 40]] *= 50  # outlier channels: plain W8A8 is far from the best
    w = torch.randn(32, 64, generator=g) * 0.05
    absmax = x.abs().amax(0)

    def error(s):  # the W8A8 product through the runtime module, against float
        lin = nn.Linear(64, 32, bias=False)
        with torch.no_grad():
            lin.weight.copy_(w * s)
        return (W8A8Linear.from_float(lin)(x / s) - x @ w.T).square().mean().item()

    s, alpha = search_alpha(x, absmax, w)
    assert alpha in ALPHAS
    torch.testing.assert_close(s, smoothing_scale(absmax, w, alpha))
    errors = [error(torch.ones(64))] + [error(smoothing_scale(absmax, w, a)) for a in ALPHAS]
    assert error(s) == pytest.approx(min(errors), rel=1e-3)
    assert error(s) < errors[0] / 4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_smoothquant_save_load_gives_identical_logits(tmp_path, arch):
    make_hf_model(arch, tmp_path / "src", intermediate_size=128)
    ref = load_model(tmp_path / "src", torch.bfloat16)
    model = load_model(tmp_path / "src", torch.bfloat16)
    config = SmoothQuant(alpha=0.6, smooth_down=True)
    records = apply(model, config, samples=SAMPLES)
    assert set(records) == {name for name, _ in decoder_linears(ref)}
    assert all(r == {"scheme": "w8a8"} for r in records.values())
    out = tmp_path / "q"
    out.mkdir()
    qformat.save(model, records, config, tmp_path / "src", out)
    assert json.loads((out / RECORD).read_text())["recipe"] == [{"method": "smoothquant", "alpha": 0.6,
                                                                      "smooth_down": True}]
    again = load_model(out, torch.bfloat16)
    logits = model(TOKENS, POSITIONS)
    assert torch.equal(logits, again(TOKENS, POSITIONS))
    expected = ref(TOKENS, POSITIONS).float()
    assert ((logits.float() - expected).norm() / expected.norm()).item() < 0.03


def test_bad_options_and_missing_data(tmp_path):
    for alpha in (-0.1, 1.5, float("nan")):
        with pytest.raises(LeanLMError, match="alpha"):
            SmoothQuant(alpha=alpha)
    make_hf_model("llama", tmp_path)
    with pytest.raises(LeanLMError, match="needs calibration data"):
        apply(load_model(tmp_path, torch.float32), SmoothQuant())
