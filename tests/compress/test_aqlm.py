import pytest
import torch

from leanlm.compress.quant import format as qformat
from leanlm import kernels
from leanlm.compress.quant.aqlm import AQLM, TunedCodebook, _KernelWeight, aqlm_quantize, assign, kmeans, nearest
from leanlm.compress.registry import apply, decoder_linears
from leanlm.errors import LeanLMError
from leanlm.lowbit.codebook import AdditiveLinear, codebook_weight
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model

SAMPLES = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))


def _weighted_error(targets, weights, books, codes) -> torch.Tensor:
    approx = sum(books[c][codes[:, c]] for c in range(books.shape[0]))
    return (weights * (targets - approx) ** 2).sum(-1)


def test_nearest_is_the_weighted_argmin():
    g = torch.Generator().manual_seed(0)
    targets, weights, book = torch.randn(500, 8, generator=g), torch.rand(500, 8, generator=g), torch.randn(256, 8,
                                                                                                         generator=g)
    brute = (weights[:, None] * (targets[:, None] - book[None]) ** 2).sum(-1).argmin(-1)
    assert torch.equal(nearest(targets, weights, book), brute)


def test_assign_improves_on_greedy_and_each_pick_is_optimal_given_the_others():
    g = torch.Generator().manual_seed(1)
    targets, weights, books = torch.randn(400, 8, generator=g), torch.rand(8, generator=g), torch.randn(3, 256, 8,
                                                                                                       generator=g)
    greedy = torch.empty(400, 3, dtype=torch.int64)
    rest = targets.clone()
    for c in range(3):  # the definition: each codebook on what the earlier ones leave
        errors = (weights * (rest[:, None] - books[c][None]) ** 2).sum(-1)
        greedy[:, c] = errors.argmin(-1)
        rest -= books[c][greedy[:, c]]
    codes = assign(targets, weights, books)
    ours, theirs = _weighted_error(targets, weights, books, codes), _weighted_error(targets, weights, books, greedy)
    assert torch.all(ours <= theirs + 1e-5) and ours.mean() < 0.95 * theirs.mean()
    others = sum(books[c][codes[:, c]] for c in range(2))  # the last pick is the best given the first two
    assert torch.equal(codes[:, 2], nearest(targets - others, weights, books[2]))


def test_the_v_step_moves_the_codes_nearest_its_target_and_down_the_gradient():
    g = torch.Generator().manual_seed(2)
    G, N = 6, 40  # 48 inputs, 40 outputs, one codebook: the re-picked code is the exact nearest codeword
    layer = TunedCodebook(None, torch.randint(0, 256, (G, 1, N), generator=g), torch.randn(1, 256, 8, generator=g),
                          torch.rand(N, generator=g) + 0.5)
    layer.track_gradient()
    x = torch.randn(16, G * 8, generator=g)
    x = x * torch.linspace(0.2, 3, G * 8)  # inputs of unequal size: the metric is the Hessian's diagonal
    layer(x).square().sum().backward()  # the hook sums d loss / d weight
    w = codebook_weight(layer.codes, layer.books.detach().transpose(1, 2), layer.scales.detach())
    grad, h = layer.grad.clone(), x.pow(2).sum(0)
    h = h / h.mean()
    a = 0.5 * w.pow(2).mean().sqrt() / (grad / h).pow(2).mean().sqrt()
    target = (w - a * grad / h) / layer.scales.detach()[:, None]  # [N, K]
    hg = h.reshape(1, G, 1, 8)
    exact = (hg * (target.reshape(N, G, 1, 8) - layer.books.detach()[0]) ** 2).sum(-1).argmin(-1).T  # [G, N]
    old = layer.codes.clone()
    changed = layer.update_codes(0.5, 0.05)
    moved = layer.codes[:, 0] != old[:, 0]
    assert 0 < changed == moved.sum() <= int(0.05 * G * N)
    assert torch.equal(layer.codes[:, 0][moved], exact[moved])  # each change is to the target's nearest codeword
    d = codebook_weight(layer.codes, layer.books.detach().transpose(1, 2), layer.scales.detach()) - w
    first_order = (grad * d).reshape(N, G, 8).sum(-1).T[moved]  # g.d of each changed group
    assert torch.all(first_order < -((h * d * d).reshape(N, G, 8).sum(-1).T[moved]) / (2 * a) + 1e-4)
    layer.track_gradient()
    assert not layer.grad.any() and not layer.h.any()  # summed afresh for the next step


@pytest.mark.skipif(kernels.ops() is None, reason="no C++ compiler: the CPU kernels cannot be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_training_weight_kernel_and_its_gradients_match_autograd_on_the_definition(dtype, threads):
    """TunedCodebook's weight by kernels/codebook.cpp: the same bits as codebook_weight's (then rounded to dtype), and
    the gradients of its codebooks and scales those of autograd through the gathers (sums in another order)."""
    g = torch.Generator().manual_seed(3)
    G, C, N = 9, 3, 70
    codes = torch.randint(0, 256, (G, C, N), generator=g)
    codes[:, :, :5] = 7  # one entry summed into from many groups
    layer = TunedCodebook(None, codes, torch.randn(C, 256, 8, generator=g), torch.rand(N, generator=g) + 0.5)
    x = torch.randn(5, G * 8, generator=g)
    ref_books = layer.books.detach().clone().requires_grad_()
    ref_scales = layer.scales.detach().clone().requires_grad_()
    ref_w = codebook_weight(codes, ref_books.transpose(1, 2), ref_scales)
    weights = torch.randn(5, N, generator=g)
    (torch.nn.functional.linear(x, ref_w.to(dtype).float()) * weights).sum().backward()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            w = _KernelWeight.apply(layer.codes, layer.books, layer.scales, dtype)
            (torch.nn.functional.linear(x.to(dtype), w).float() * weights).sum().backward()
    finally:
        torch.set_num_threads(before)
    assert w.dtype == dtype and torch.equal(w, ref_w.detach().to(dtype))
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the product's gradient arrives rounded
    for ours, ref in [(layer.books.grad, ref_books.grad), (layer.scales.grad, ref_scales.grad)]:
        assert torch.allclose(ours, ref, rtol=tol, atol=tol * ref.abs().max())
    assert layer.books.grad[:, 7].abs().sum() > 0


def test_kmeans_lowers_the_distortion_of_its_start():
    g = torch.Generator().manual_seed(2)
    vectors = torch.randn(4000, 8, generator=g) * torch.linspace(0.2, 2, 8)
    weights = torch.ones_like(vectors)
    start, book = kmeans(vectors, weights, 0, torch.Generator().manual_seed(0)), kmeans(
        vectors, weights, 10, torch.Generator().manual_seed(0))
    distortion = [(vectors - b[nearest(vectors, weights, b)]).pow(2).sum(-1).mean() for b in (start, book)]
    assert distortion[1] < 0.8 * distortion[0]


def _layer_objective(W, H, codes, books, scales) -> float:
    diff = W - codebook_weight(codes, books.transpose(1, 2), scales)  # aqlm_quantize's books: [C, 256, 8]
    return (((diff @ H) * diff).sum() / ((W @ H) * W).sum()).item()


def test_more_codebooks_and_more_rounds_fit_the_layer_better():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(64, 128, generator=g)
    X = torch.randn(512, 128, generator=g) * torch.linspace(0.1, 3, 128)  # unequal input scales
    H = 2 * X.T @ X / 512
    err = {(C, r): _layer_objective(W, H, *aqlm_quantize(W, H, C, rounds=r, fit_steps=20)) for C in (1, 2, 4)
           for r in (1, 2)}
    assert err[(4, 2)] < err[(2, 2)] < err[(1, 2)] < 1
    assert err[(2, 2)] <= err[(2, 1)]


def _logit_error(model, ref) -> float:
    positions = torch.arange(SAMPLES.shape[1])[None].expand(SAMPLES.shape[0], -1)
    with torch.no_grad():
        return (model(SAMPLES, positions) - ref(SAMPLES, positions)).pow(2).mean().item()


def test_block_tuning_fits_the_float_model_better_and_saves_exactly(tmp_path):
    make_hf_model("llama", tmp_path / "src")
    ref = load_model(tmp_path / "src", torch.float32)
    errors = {}
    for iters in (0, 30):
        model = load_model(tmp_path / "src", torch.float32)
        config = AQLM(bits=2, iters=iters, fit_steps=10, lr=3e-3)
        records = apply(model, config, samples=SAMPLES)
        errors[iters] = _logit_error(model, ref)
    assert errors[30] < 0.9 * errors[0]
    assert set(records) == {n for n, _ in decoder_linears(ref)} and not list(decoder_linears(model))
    assert all(isinstance(model.get_submodule(n), AdditiveLinear) for n in records)
    out = tmp_path / "q"
    out.mkdir()
    qformat.save(model, records, config, tmp_path / "src", out)
    again = load_model(out, torch.float32)
    assert _logit_error(again, model) == 0.0


def test_layers_give_projections_their_own_codebooks_and_save(tmp_path):
    make_hf_model("llama", tmp_path / "src")
    model = load_model(tmp_path / "src", torch.float32)
    config = AQLM(bits=2, iters=0, fit_steps=2, rounds=1, kmeans_iters=1,
                  layers={"layers.*.mlp.down_proj": 3, "layers.0.mlp.down_proj": 1})
    records = apply(model, config, samples=SAMPLES)
    codebooks = {n: model.get_submodule(n).codebooks.shape[0] for n in records}
    assert codebooks["layers.0.mlp.down_proj"] == 1 and codebooks["layers.1.mlp.down_proj"] == 3
    assert {c for n, c in codebooks.items() if not n.endswith("down_proj")} == {2}
    out = tmp_path / "q"
    out.mkdir()
    qformat.save(model, records, config, tmp_path / "src", out)
    again = load_model(out, torch.float32)
    assert {n: again.get_submodule(n).codebooks.shape[0] for n in records} == codebooks
    assert _logit_error(again, model) == 0.0


def test_a_layers_pattern_that_matches_nothing_is_an_error(tmp_path):
    make_hf_model("llama", tmp_path / "src")
    with pytest.raises(LeanLMError, match="'layers.\\*.mlp.down' match no decoder projection"):
        apply(load_model(tmp_path / "src", torch.float32), AQLM(layers={"layers.*.mlp.down": 3}), samples=SAMPLES)


@pytest.mark.parametrize("kwargs", [dict(bits=5), dict(bits=0), dict(iters=-1), dict(rounds=0), dict(lr=0.0),
                                    dict(batch_size=0), dict(layers={"layers.*.mlp.down_proj": 5}),
                                    dict(layers={"layers.*": True}), dict(layers=["layers.*"])])
def test_bad_options(kwargs):
    with pytest.raises(LeanLMError):
        AQLM(**kwargs)


def test_needs_calibration_data(tmp_path):
    make_hf_model("llama", tmp_path / "src")
    with pytest.raises(LeanLMError, match="calibration"):
        apply(load_model(tmp_path / "src", torch.float32), AQLM())


def test_compiled_decode_runs_the_codebook_kernel_as_eager(tmp_path):
    from leanlm.generation.compiled import CompiledDecoder
    from leanlm.generation.decode import decode_step, prefill

    make_hf_model("qwen2", tmp_path)
    model = load_model(tmp_path, torch.float32)
    apply(model, AQLM(bits=2, iters=0, rounds=1, fit_steps=2, kmeans_iters=2), samples=SAMPLES)
    compiled = CompiledDecoder(model)
    logits_e, cache_e = prefill(model, [[5, 6, 7, 8, 9]], 6)
    logits_c, cache_c = prefill(model, [[5, 6, 7, 8, 9]], 6)
    tok_e = tok_c = logits_e.argmax(-1)
    for _ in range(4):
        logits_e, logits_c = decode_step(model, cache_e, tok_e), compiled.decode_step(cache_c, tok_c)
        assert torch.allclose(logits_c, logits_e, atol=1e-4)
        tok_e, tok_c = logits_e.argmax(-1), logits_c.argmax(-1)
