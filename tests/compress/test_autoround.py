import pytest
import torch

from leanlm.compress.quant import format as qformat
from leanlm.compress.quant.autoround import AutoRound, TunedWeight
from leanlm.compress.quant.rtn import RTN
from leanlm.compress.registry import apply, decoder_linears
from leanlm.errors import LeanLMError
from leanlm.lowbit.linear import W4A16Linear
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model

SAMPLES = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def src(tmp_path):
    make_hf_model("llama", tmp_path / "src")
    return tmp_path / "src"


def test_no_steps_is_round_to_nearest(src):
    tuned, rtn = load_model(src, torch.float32), load_model(src, torch.float32)
    apply(tuned, AutoRound(group_size=32, iters=0), samples=SAMPLES)
    apply(rtn, RTN(4, 32))
    for name, m in decoder_linears(rtn):
        ours = tuned.get_submodule(name)
        for buffer in ("weight_packed", "scales", "zeros"):
            assert torch.equal(getattr(ours, buffer), getattr(m, buffer)), (name, buffer)


def _full_range(w: torch.Tensor, g: int) -> torch.Tensor:
    """The auto-round package's symmetric grid by its definition: a group's extreme of larger magnitude e is code -8,
    the step -e / 8, codes -8..7."""
    groups = w.reshape(w.shape[0], -1, g)
    hi, lo = groups.amax(-1, keepdim=True), groups.amin(-1, keepdim=True)
    step = -torch.where(hi > -lo, hi, lo) / 8
    return ((groups / step).round().clamp(-8, 7) * step).flatten(1)


def test_no_steps_is_the_full_range_grid_when_symmetric(src):
    ref, tuned = load_model(src, torch.float32), load_model(src, torch.float32)
    apply(tuned, AutoRound(group_size=32, iters=0, symmetric=True), samples=SAMPLES)
    for name, m in decoder_linears(ref):
        expected = _full_range(m.weight.detach(), 32)
        got = tuned.get_submodule(name).dequantized_weight()
        assert torch.allclose(got, expected, rtol=2 ** -7, atol=0), name  # scales stored in bf16
        groups = m.weight.detach().reshape(m.weight.shape[0], -1, 32)
        error = (got - m.weight).abs().reshape(groups.shape) / (groups.abs().amax(-1, keepdim=True) / 8)
        assert error.max() <= 1.05  # the other extreme, up to 8 steps away at code 7, loses up to one (+ bf16 scale)
        assert (error <= 0.51).float().mean() > 0.99


def test_grid_is_the_weight_it_was_tuned_with():
    linear = torch.nn.Linear(64, 32, bias=True)
    for symmetric in (False, True):
        t = TunedWeight(linear, 32, symmetric)
        with torch.no_grad():  # somewhere inside the box the tuning keeps them in
            for p in t.parameters():
                p.uniform_(0.5, 1.0) if p is not t.v else p.uniform_(-0.5, 0.5)
        codes, scale, mid = t.grid()
        assert int(codes.max()) <= 15 and torch.all(scale > 0)
        assert list(t.parameters()) == [t.v, t.alpha, t.beta]  # the bias is not tuned
        packed = W4A16Linear.from_codes(linear, 32, codes, scale, mid)
        expected = t.weight().detach()
        assert torch.allclose(packed.dequantized_weight(), expected, rtol=0, atol=0.02 * expected.abs().max())
        if symmetric:  # zero is a code: mid is 0, or one step where the codes were flipped for a positive scale
            assert torch.all((mid == 0) | (mid == scale)) and torch.any(mid == 0) and torch.any(mid > 0)


def _logit_error(model, ref) -> float:
    positions = torch.arange(SAMPLES.shape[1])[None].expand(SAMPLES.shape[0], -1)
    with torch.no_grad():
        return (model(SAMPLES, positions) - ref(SAMPLES, positions)).pow(2).mean().item()


@pytest.mark.parametrize("symmetric", [False, True])
def test_tuning_fits_the_float_model_better_than_rounding(src, tmp_path, symmetric):
    ref = load_model(src, torch.float32)
    errors = {}
    for steps in (0, 40):
        model = load_model(src, torch.float32)
        records = apply(model, AutoRound(group_size=32, iters=steps, lr=0.01, symmetric=symmetric), samples=SAMPLES)
        errors[steps] = _logit_error(model, ref)
    assert errors[40] < 0.8 * errors[0]
    assert set(records) == {n for n, _ in decoder_linears(ref)}
    out = tmp_path / "q"
    out.mkdir()
    qformat.save(model, records, AutoRound(group_size=32, iters=40, lr=0.01, symmetric=symmetric), src, out)
    again = load_model(out, torch.float32)
    assert _logit_error(again, model) == 0.0


@pytest.mark.parametrize("kwargs", [dict(bits=8), dict(group_size=48), dict(iters=-1), dict(lr=0.0),
                                    dict(batch_size=0)])
def test_bad_options(kwargs):
    with pytest.raises(LeanLMError):
        AutoRound(**kwargs)


def test_needs_calibration_data(src):
    with pytest.raises(LeanLMError, match="calibration"):
        apply(load_model(src, torch.float32), AutoRound())
