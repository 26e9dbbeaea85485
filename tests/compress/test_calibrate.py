import pytest
import torch

from leanlm.compress.calibrate import calibrate
from leanlm.compress.registry import decoder_linears
from leanlm.lowbit.record import replace
from leanlm.models.layers import Linear
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model

N, T = 10, 16  # two mini-batches at the default batch size of 8, the second one partial


class XtX:
    """The naive statistic: sum of x^T x over every input row, in float64."""

    def __init__(self, linear):
        self.sum = torch.zeros(linear.in_features, linear.in_features, dtype=torch.float64)
        self.rows = 0

    def add_batch(self, x):
        assert x.dtype == torch.float32 and x.shape[-1] == self.sum.shape[0]
        x = x.reshape(-1, x.shape[-1]).double()
        self.sum += x.T @ x
        self.rows += x.shape[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama", path)
    return path


def samples():
    return torch.randint(0, 128, (N, T), generator=torch.Generator().manual_seed(0))


def reference_stats(model, tokens):
    """XtX of every decoder Linear's inputs, hooked on one plain full forward."""
    stats = {name: XtX(m) for name, m in decoder_linears(model)}
    hooks = [m.register_forward_hook(lambda mod, args, out, s=stats[name]: s.add_batch(args[0].float()))
             for name, m in decoder_linears(model)]
    with torch.no_grad():
        model(tokens, torch.arange(T)[None].expand(N, -1))
    for h in hooks:
        h.remove()
    return stats


def run_calibrate(model, tokens, perturb=None, **kw):
    """calibrate() with XtX stats; returns {name: XtX} as handed to solve."""
    seen = {}

    def solve(i, block, found):
        assert all(name.startswith(f"layers.{i}.") and isinstance(lin, Linear) for name, (lin, _) in found.items())
        seen.update({name: s for name, (_, s) in found.items()})
        if perturb is not None and i == 0:
            perturb(block)

    calibrate(model, tokens, solve, XtX, **kw)
    return seen


def assert_same_stats(got, want):
    assert set(got) == set(want)
    for name in want:
        assert got[name].rows == want[name].rows == N * T
        torch.testing.assert_close(got[name].sum, want[name].sum, rtol=1e-5, atol=1e-4, msg=name)


def test_stats_equal_inputs_of_a_full_forward(model_dir):
    model = load_model(model_dir, torch.float32)
    tokens = samples()
    want = reference_stats(model, tokens)
    assert {n.split(".")[1] for n in want} == {"0", "1"}  # both blocks, all four Linears each
    assert len(want) == 8
    assert_same_stats(run_calibrate(model, tokens), want)


def perturb(block):
    """Change block 0 in place and by replacing a module, as quantizers and pruners do."""
    torch.manual_seed(1)
    block.self_attn.qkv_proj.weight.add_(0.05 * torch.randn_like(block.self_attn.qkv_proj.weight))
    old = block.mlp.down_proj
    new = Linear(old.in_features, old.out_features, bias=False)
    new.weight.copy_(old.weight * 1.5)
    replace(block, "mlp.down_proj", new)


def test_next_block_calibrates_on_the_modified_blocks_outputs(model_dir):
    model, tokens = load_model(model_dir, torch.float32), samples()
    clean = reference_stats(model, tokens)
    got = run_calibrate(model, tokens, perturb=perturb)
    expected_model = load_model(model_dir, torch.float32)
    with torch.no_grad():
        perturb(expected_model.layers[0])
    want = reference_stats(expected_model, tokens)
    # block 0 was calibrated before its change; block 1 sees the perturbed block 0's outputs
    assert_same_stats({n: s for n, s in got.items() if n.startswith("layers.0.")},
                      {n: s for n, s in clean.items() if n.startswith("layers.0.")})
    assert_same_stats({n: s for n, s in got.items() if n.startswith("layers.1.")},
                      {n: s for n, s in want.items() if n.startswith("layers.1.")})
    assert not torch.allclose(want["layers.1.self_attn.qkv_proj"].sum, clean["layers.1.self_attn.qkv_proj"].sum)


def test_noop_calibration_leaves_model_unchanged_and_batching_does_not_matter(model_dir):
    model, tokens = load_model(model_dir, torch.float32), samples()
    positions = torch.arange(T)[None].expand(N, -1)
    with torch.no_grad():
        before = model(tokens, positions)
    calls = []
    one = run_calibrate(model, tokens, batch_size=1, progress=calls.append)
    eight = run_calibrate(model, tokens, batch_size=8)
    everything = run_calibrate(model, tokens, batch_size=N)
    assert calls == ["layers.0", "layers.1"]
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(tokens, positions), before)
    assert_same_stats(one, eight)
    assert_same_stats(everything, eight)


@pytest.mark.parametrize("sequential", [False, True])
def test_sequential_solves_each_linear_on_inputs_through_the_solved_ones(model_dir, sequential):
    # Zeroing qkv_proj makes the attention output (o_proj's input) exactly zero; only a sequential
    # calibration collects o_proj's inputs after that edit.
    model = load_model(model_dir, torch.float32)
    order, o_rows = [], []

    def solve(index, block, linears):
        order.append(list(linears))
        for name, (linear, stats) in linears.items():
            if name.endswith("qkv_proj"):
                linear.weight.zero_()
            if name.endswith("o_proj"):
                o_rows.append(stats.sum.abs().max().item())

    calibrate(model, samples(), solve, XtX, sequential=sequential)
    blocks = model.config.num_layers
    assert len(order) == (4 * blocks if sequential else blocks)
    assert [n.rsplit(".", 1)[1] for n in sum(order[:4 if sequential else 1], [])] == ["qkv_proj", "o_proj",
                                                                                       "gate_up_proj", "down_proj"]
    assert (max(o_rows) == 0) == sequential
