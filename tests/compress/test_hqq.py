import pytest
import torch

from leanlm.compress.quant.gptq import GPTQ
from leanlm.compress.quant.hqq import HQQ, hqq_quantize, shrink
from leanlm.compress.quant.rtn import RTN
from leanlm.compress.registry import apply, decoder_linears
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W4A16Linear, unpack_int4
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model


def _weight(N=64, K=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.02
    w[torch.rand(N, K, generator=g) < 0.01] *= 8  # a few outliers per group, as real weights have
    return w


def _dequant(codes, scale, mid, g):
    N, K = codes.shape
    return ((codes.float().reshape(N, K // g, g) - 8) * scale[..., None] + mid[..., None]).reshape(N, K)


def _reference_hqq(W, g, iters=20, p=0.7, beta=10.0, kappa=1.01):
    """The published solver as written, in its zero-point form q = round(W / s + z), in float64, no bf16 rounding:
    z <- mean(q - (W - shrink(W - (q - z) s)) / s), stopping at the first iterate that does not improve."""
    w = W.double().reshape(-1, g)
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    s = (hi - lo) / 15
    z = -lo / s
    best = float("inf")
    for _ in range(iters):
        q = (w / s + z).round().clamp(0, 15)
        err = w - (q - z) * s
        if err.abs().mean().item() >= best:
            break
        best = err.abs().mean().item()
        e = err.sign() * (err.abs() - err.abs().clamp_min(1e-12).pow(p - 1) / beta).clamp_min(0)
        z = (q - (w - e) / s).mean(1, keepdim=True)
        beta *= kappa
    return best


def test_shrink_is_the_proximal_step():
    x = torch.linspace(-2, 2, 41)
    assert torch.allclose(shrink(x, 2.0, 1.0), x.sign() * (x.abs() - 0.5).clamp_min(0))  # soft threshold at p = 1
    y = shrink(x, 10.0, 0.7)
    assert torch.all(y.abs() <= x.abs()) and torch.all(y * x >= 0)  # shrinks towards 0, never past it
    big, small = x.abs() > 1, x.abs() < 0.01
    assert torch.all(y[small] == 0) and torch.all((x[big] - y[big]).abs() < 0.1)  # small errors go, outliers stay


def test_solver_lowers_the_error_and_matches_the_reference():
    W = _weight()
    errors = {}
    for iters in (0, 20):
        codes, scale, mid = hqq_quantize(W, 64, iters=iters)
        assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
        assert torch.equal(scale, scale.bfloat16().float()) and torch.equal(mid, mid.bfloat16().float())
        errors[iters] = (_dequant(codes, scale, mid, 64) - W).abs().mean().item()
    lo, hi = W.reshape(64, 4, 64).amin(-1), W.reshape(64, 4, 64).amax(-1)
    minmax = (_dequant(*hqq_quantize(W, 64, iters=0), 64) - W).abs()
    assert minmax.max() <= ((hi - lo) / 15).max() * 0.6  # iters 0 is the min-max grid: half a step, plus bf16
    assert errors[20] < 0.97 * errors[0]
    assert errors[20] <= 1.02 * _reference_hqq(W, 64)  # the published solver, up to our bf16 scale and offset


def test_symmetric_grid_is_absmax():
    W = _weight()
    lin = torch.nn.Linear(256, 64, bias=False)
    lin.weight.data = W
    m = W4A16Linear.from_float(lin, 32, symmetric=True)
    assert torch.all(m.zeros == 0)  # the weight at code 8 is 0: codes -8..7 around zero
    scale = (W.reshape(64, 8, 32).abs().amax(-1) / 7)[..., None]  # [N, K/g, 1]

    def naive(rounding_scale):  # codes by one scale, weights by the bf16 scale the kernel stores
        return ((W.reshape(64, 8, 32) / rounding_scale).round().clamp(-8, 7) * scale.bfloat16().float()).reshape(W.shape)

    assert torch.equal(m.dequantized_weight(), naive(scale))
    assert torch.equal(_dequant(*hqq_quantize(W, 32, symmetric=True), 32), naive(scale.bfloat16().float()))


@pytest.mark.parametrize("config", [HQQ(group_size=32), HQQ(group_size=32, symmetric=True), RTN(4, 32, symmetric=True)])
def test_every_projection_lands_on_its_grid(tmp_path, config):  # saving and loading: test_rtn_format
    make_hf_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src", torch.bfloat16)
    ref = load_model(tmp_path / "src", torch.bfloat16)
    records = apply(model, config)
    assert set(records) == {n for n, _ in decoder_linears(ref)}
    for name, layer in decoder_linears(ref):  # every projection on the int4 grid, close to its float weight
        q = model.get_submodule(name)
        assert isinstance(q, W4A16Linear)
        rel = (q.dequantized_weight() - layer.weight.float()).norm() / layer.weight.float().norm()
        assert rel < 0.2
        if config.symmetric:
            assert torch.all(q.zeros == 0)


def test_gptq_symmetric_stays_on_the_absmax_grid(tmp_path):
    make_hf_model("llama", tmp_path)
    model = load_model(tmp_path, torch.float32)
    samples = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    apply(model, GPTQ(group_size=32, symmetric=True), samples=samples)
    for _, q in ((n, m) for n, m in model.named_modules() if isinstance(m, W4A16Linear)):
        assert torch.all(q.zeros == 0)
        assert int(unpack_int4(q.weight_packed).max()) <= 15


@pytest.mark.parametrize("kwargs", [dict(bits=3), dict(group_size=48), dict(iters=-1), dict(lp_norm=0.0),
                                    dict(lp_norm=1.5), dict(beta=0.0), dict(kappa=0.5)])
def test_bad_options(kwargs):
    with pytest.raises(LeanLMError):
        HQQ(**kwargs)
