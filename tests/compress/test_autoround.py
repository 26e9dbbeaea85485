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


@pytest.mark.parametrize("symmetric", [False, True])
def test_no_steps_is_round_to_nearest(src, symmetric):
    tuned, rtn = load_model(src, torch.float32), load_model(src, torch.float32)
    apply(tuned, AutoRound(group_size=32, iters=0, symmetric=symmetric), samples=SAMPLES)
    apply(rtn, RTN(4, 32, symmetric=symmetric))
    for name, m in decoder_linears(rtn):
        ours = tuned.get_submodule(name)
        for buffer in ("weight_packed", "scales", "zeros"):
            assert torch.equal(getattr(ours, buffer), getattr(m, buffer)), (name, buffer)


def test_grid_is_the_weight_it_was_tuned_with():
    linear = torch.nn.Linear(64, 32, bias=True)
    for symmetric in (False, True):
        t = TunedWeight(linear, 32, symmetric)
        with torch.no_grad():  # somewhere inside the box the tuning keeps them in
            for p in t.parameters():
                p.uniform_(0.5, 1.0) if p is not t.v else p.uniform_(-0.5, 0.5)
        codes, scale, mid = t.grid()
        assert int(codes.max()) <= 15  # the bias is not tuned; a symmetric grid has no lower clip ratio
        assert list(t.parameters()) == ([t.v, t.alpha] if symmetric else [t.v, t.alpha, t.beta])
        packed = W4A16Linear.from_codes(linear, 32, codes, scale, mid)
        expected = t.weight().detach()
        assert torch.allclose(packed.dequantized_weight(), expected, rtol=0, atol=0.02 * expected.abs().max())
        if symmetric:
            assert torch.all(mid == 0)


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
