import pytest
import torch
import torch.nn.functional as F

from leanlm import kernels
from leanlm.compress.registry import apply
from leanlm.engine import LLM
from leanlm.generation.sampling import SamplingParams
from leanlm.lowbit.linear import (PackedW4A8Linear, PackedW8A8Linear, PackedW8A16Linear, W4A8Linear,
                                  W4A16Linear, W8A8Linear, W8A16Linear)
from leanlm.models.layers import Linear, PackedEmbedding, PackedLinear, pack_linears
from leanlm.models.loading import load_model
from leanlm.pipeline import make_config

needs_packed = pytest.mark.skipif(not kernels.packed_bf16(),
                                  reason="bf16_packed_gemm's vector loops need AVX512-BF16 or AVX2")
needs_simd = pytest.mark.skipif(kernels.ops() is None or kernels.ops().isa() == "portable",
                                reason="the W8A16 and W8A8 packed products' vector loops need AVX-512 VNNI or AVX2")
needs_vnni = pytest.mark.skipif(kernels.ops() is None or kernels.ops().isa() != "avx512",
                                reason="int8_packed_gemm's vector loops need AVX-512 VNNI")


def _linear(N: int, K: int, bias: bool = False) -> Linear:
    torch.manual_seed(N + K)
    return Linear(K, N, bias=bias).to(torch.bfloat16)


@needs_packed
def test_packed_linear_matches_the_linear_and_keeps_its_weight():
    lin = _linear(48, 200, bias=True)
    packed = PackedLinear(lin)
    assert torch.equal(packed.weight, lin.weight)
    x = torch.randn(2, 5, 200).bfloat16()
    y = packed(x)
    ref = x.double() @ lin.weight.double().T + lin.bias.double()
    assert y.shape == (2, 5, 48) and y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 2 ** -7


@needs_packed
def test_a_row_gets_the_same_bits_in_any_batch():
    """Each row's sums run in the same order whatever the number of rows: a sequence's logits do not depend on
    the batch it decodes in (torch's GEMM picks its blocking by the row count)."""
    packed = PackedLinear(_linear(96, 576))
    x = torch.randn(19, 576).bfloat16()
    whole = packed(x)
    assert all(torch.equal(packed(x[i:i + 1]), whole[i:i + 1]) for i in range(19))
    assert torch.equal(packed(x[3:12]), whole[3:12])


@needs_packed
def test_a_packed_linear_cast_from_bf16_falls_back_to_torch():
    lin = _linear(32, 64, bias=True)
    packed = PackedLinear(lin).float()
    x = torch.randn(3, 64)
    assert torch.allclose(packed(x), F.linear(x, lin.weight.float(), lin.bias.float()))


@needs_packed
def test_pack_linears_swaps_the_bf16_linears_and_the_tied_pair(tiny_dir):
    model, reference = load_model(tiny_dir, torch.bfloat16), load_model(tiny_dir, torch.bfloat16)
    assert model.lm_head_is_embedding
    memory = model.layers[0].mlp.down_proj.weight.data_ptr()
    table = model.embed_tokens.weight.data_ptr()
    assert pack_linears(model) == 4 * model.config.num_layers + 1
    assert model.layers[0].mlp.down_proj.packed.data_ptr() == memory  # packed where it was: no second copy
    assert type(model.lm_head) is PackedLinear and type(model.embed_tokens) is PackedEmbedding
    assert model.embed_tokens.packed is model.lm_head.packed and model.lm_head.packed.data_ptr() == table
    assert model.lm_head_is_embedding and model.dtype == torch.bfloat16
    assert torch.equal(model.embed_tokens.weight, reference.embed_tokens.weight)
    assert pack_linears(model) == 0  # already packed
    tokens = torch.randint(0, model.config.vocab_size, (2, 24))
    positions = torch.arange(24)[None].expand(2, -1)
    assert torch.equal(model.embed_tokens(tokens), reference.embed_tokens(tokens))
    with torch.inference_mode():
        got, want = model(tokens, positions).float(), reference(tokens, positions).float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@needs_packed
def test_llm_packs_the_model_it_loads_and_leaves_a_given_one(tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    loaded = LLM(str(tiny_dir), dtype="bfloat16", threads=1, kv_cache_memory="8MiB", quiet=True)
    assert any(isinstance(m, PackedLinear) for m in loaded.engine.model.modules())
    unpacked = LLM(str(tiny_dir), dtype="bfloat16", threads=1, kv_cache_memory="8MiB", quiet=True, pack_weights=False)
    assert not any(isinstance(m, PackedLinear) for m in unpacked.engine.model.modules())
    model = unpacked.engine.model
    given = LLM(model, unpacked.engine.tokenizer, threads=1, kv_cache_memory="8MiB", quiet=True)
    assert given.engine.model is model and not any(isinstance(m, PackedLinear) for m in model.modules())
    out = loaded.generate(["hello world"], params, progress=False)[0].outputs[0]
    assert len(out.token_ids) == 6


@needs_simd
@pytest.mark.parametrize("act_scale", [None, 0.02])  # per-token codes, one calibrated scale
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_w8a8_gives_the_w8a8_layers_bits(act_scale, dtype):
    torch.manual_seed(0)
    layer = W8A8Linear.from_float(torch.nn.Linear(200, 48, bias=True), act_scale=act_scale)
    codes = layer.weight.clone()
    x = torch.randn(2, 5, 200).to(dtype)
    want = layer(x)
    memory = layer.weight.data_ptr()
    packed = PackedW8A8Linear(layer, in_place=True)
    assert packed.packed.data_ptr() == memory and torch.equal(packed.weight, codes)
    got = packed(x)
    assert got.shape == (2, 5, 48) and got.dtype == dtype and torch.equal(got, want)
    assert packed.options() == layer.options() and packed.bits_per_weight == layer.bits_per_weight


@needs_simd
def test_pack_linears_swaps_the_w8a8_layers_and_keeps_the_logits(tiny_dir):
    model, reference = (load_model(tiny_dir, torch.bfloat16) for _ in range(2))
    for m in (model, reference):
        apply(m, make_config("rtn", {"bits": 8, "act_bits": 8}))
    pack_linears(model)
    layers = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert layers and all(type(m) is PackedW8A8Linear for m in layers)
    tokens = torch.randint(0, model.config.vocab_size, (2, 24))
    positions = torch.arange(24)[None].expand(2, -1)
    with torch.inference_mode():
        assert torch.equal(model(tokens, positions), reference(tokens, positions))


@needs_simd
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_w8a16_matches_the_w8a16_layer_and_any_batch(bias, dtype, monkeypatch):
    """The same int16-rounded rows and codes as W8A16Linear's int8_gemv, summed in another order: equal but for
    float32 rounding; a row's bits do not depend on the rows beside it. Both layers take their kernels at 10 rows
    whatever kernels.w8a16_rows() timed (a timing taken beside other work once gave 4: the widened codes)."""
    monkeypatch.setitem(kernels._loaded, "w8a16_rows", 16)
    torch.manual_seed(0)
    layer = W8A16Linear.from_float(torch.nn.Linear(600, 48, bias=bias))
    codes = layer.weight.clone()
    x = torch.randn(2, 5, 600).to(dtype)
    want = layer(x.float())  # float32 out: the comparison is not blurred by a bf16 rounding
    memory = layer.weight.data_ptr()
    packed = PackedW8A16Linear(layer, in_place=True)
    assert packed.packed.data_ptr() == memory and torch.equal(packed.weight, codes)
    got = packed(x)
    assert got.shape == (2, 5, 48) and got.dtype == dtype
    assert torch.allclose(packed(x.float()), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.equal(packed(x[1, 2:3]), got[1, 2:3])
    assert packed.bits_per_weight == layer.bits_per_weight and packed.record() == layer.record()


@needs_simd
def test_pack_linears_swaps_the_w8a16_layers_and_keeps_the_logits(tiny_dir, monkeypatch):
    """Against the dequantized weights in float32 (W8A16Linear's own paths round x to bf16 past a few rows)."""
    model, reference = (load_model(tiny_dir, torch.float32) for _ in range(2))
    for m in (model, reference):
        apply(m, make_config("rtn", {"bits": 8}))
    pack_linears(model)
    layers = [m for m in model.modules() if isinstance(m, W8A16Linear)]
    assert layers and all(type(m) is PackedW8A16Linear for m in layers)
    monkeypatch.setattr(W8A16Linear, "forward", W8A16Linear._reference)
    tokens = torch.randint(0, model.config.vocab_size, (2, 24))
    positions = torch.arange(24)[None].expand(2, -1)
    with torch.inference_mode():
        got, want = model(tokens, positions), reference(tokens, positions)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@needs_vnni
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_w4a8_matches_the_w4a8_layer_and_any_batch(bias, dtype):
    """W4A8Linear runs x's int8 codes, dequantized, through W4A16's paths; the packed layer multiplies the same codes
    by vpdpbusd: equal but for float32 rounding, and a row's bits do not depend on the rows beside it."""
    torch.manual_seed(0)
    layer = W4A8Linear.from_float(torch.nn.Linear(640, 48, bias=bias), group_size=64)
    assert isinstance(layer, W4A16Linear) and layer.record() == {"scheme": "w4a8", "group_size": 64}
    codes = layer.weight_packed.clone()
    x = torch.randn(2, 5, 640).to(dtype)
    want = layer(x.float())
    memory = layer.weight_packed.data_ptr()
    packed = PackedW4A8Linear(layer, in_place=True)
    assert packed.packed.data_ptr() == memory and torch.equal(packed.weight_packed, codes)
    got = packed(x)
    assert got.shape == (2, 5, 48) and got.dtype == dtype
    assert torch.allclose(packed(x.float()), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert torch.equal(packed(x[1, 2:3]), got[1, 2:3])
    assert packed.bits_per_weight == layer.bits_per_weight and packed.record() == layer.record()


@needs_vnni
def test_pack_linears_swaps_the_w4a8_layers_and_keeps_the_logits(tiny_dir):
    model, reference = (load_model(tiny_dir, torch.float32) for _ in range(2))
    for m in (model, reference):
        apply(m, make_config("rtn", {"bits": 4, "group_size": 32, "act_bits": 8}))
    pack_linears(model)
    layers = [m for m in model.modules() if isinstance(m, W4A8Linear)]
    assert layers and all(type(m) is PackedW4A8Linear for m in layers)
    tokens = torch.randint(0, model.config.vocab_size, (2, 24))
    positions = torch.arange(24)[None].expand(2, -1)
    with torch.inference_mode():
        got, want = model(tokens, positions), reference(tokens, positions)
    # an activation whose int8 code rounds the other way in one path moves later layers by a code's step
    assert ((got - want).norm() / want.norm()).item() < 0.01


def test_the_fused_elementwise_ops_keep_the_logits(tiny_dir, monkeypatch):
    """RMSNorm, SiLU-and-multiply and the rotary embedding as leanlm's ops (eager bf16 CPU) against the torch
    expressions they replace: the same logits but for last-bit roundings."""
    import leanlm.models.layers as layers

    if kernels.ops() is None:
        pytest.skip("no C++ compiler: the kernels cannot be built here")
    model = load_model(tiny_dir, torch.bfloat16)
    tokens = torch.randint(0, model.config.vocab_size, (2, 24))
    positions = torch.arange(24)[None].expand(2, -1)
    calls = []
    real = layers.fused_ops
    monkeypatch.setattr(layers, "fused_ops", lambda *a: calls.append(real(*a)) or calls[-1])
    with torch.inference_mode():
        fused = model(tokens, positions).float()
        monkeypatch.setattr(layers, "fused_ops", lambda *a: None)
        plain = model(tokens, positions).float()
    used = [ops for ops in calls if ops is not None]
    assert len(used) >= 3 * model.config.num_layers  # every layer's two norms and its MLP at least
    assert (fused - plain).abs().max() <= 0.03 * plain.abs().max()
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.9


needs_amx = pytest.mark.skipif(not kernels.amx(), reason="no AMX tiles here")


@needs_amx
@pytest.mark.parametrize("M,K,N", [(1, 576, 64), (17, 576, 1536), (70, 1536, 576)])
def test_amx_products_on_the_packed_layouts(M, K, N):
    """bf16_packed_amx and w8a16_packed_amx: float32 sums of exact products (bf16 rows, bf16 weights or int8 codes),
    a row's bits the same alone; int8_packed_amx: int8_packed_gemm's bits (exact int32 sums, the same epilogue)."""
    gen = torch.Generator().manual_seed(M)
    ops, x = kernels.ops(), torch.randn(M, K, generator=gen).bfloat16()
    w = torch.randn(N, K, generator=gen).bfloat16()
    exact = x.double() @ w.double().T
    got = ops.bf16_packed_amx(x, kernels.pack_bf16(w))
    assert got.dtype == torch.bfloat16 and ((got.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-5).all()
    assert torch.equal(ops.bf16_packed_amx(x[-1:].contiguous(), kernels.pack_bf16(w)), got[-1:])
    codes, scale = torch.randint(-127, 128, (N, K), generator=gen, dtype=torch.int8), torch.rand(N).bfloat16()
    exact = (x.double() @ codes.double().T) * scale.double()
    got = ops.w8a16_packed_amx(x, kernels.pack_pairs(codes), scale, torch.float32)
    assert ((got.double() - exact).abs() <= 1e-5 * exact.abs().amax()).all()
    xq, xs = ops.quantize_rows(x)
    for dtype in (torch.float32, torch.bfloat16):
        want = ops.int8_packed_gemm(xq, xs, kernels.pack_int8(codes), scale.float(), dtype)
        assert torch.equal(ops.int8_packed_amx(xq, xs, kernels.pack_int8(codes), scale.float(), dtype), want)


@needs_amx
def test_packed_layers_take_amx_tiles(monkeypatch):
    """On AMX: a PackedLinear (K a multiple of 32) at any row count, PackedW8A8Linear past AMX_INT8_ROWS (K a
    multiple of 64), PackedW8A16Linear past AMX_W8_PACKED_ROWS on bf16 rows; the vector loops otherwise."""
    real, calls = kernels.ops(), []
    names = ("bf16_packed_amx", "bf16_packed_gemm", "int8_packed_amx", "int8_packed_gemm", "w8a16_packed_amx",
             "w8a16_packed_gemm", "quantize_rows")
    fake = type("Ops", (), {n: staticmethod(lambda *a, n=n: calls.append(n) or getattr(real, n)(*a)) for n in names})
    monkeypatch.setattr(kernels, "ops", lambda: fake)
    torch.manual_seed(0)
    cases = [(PackedLinear(_linear(48, 64)), 1, "bf16_packed_amx"), (PackedLinear(_linear(48, 200)), 9,
                                                                     "bf16_packed_gemm")]
    for K in (128, 96):
        w8a8 = PackedW8A8Linear(W8A8Linear.from_float(torch.nn.Linear(K, 48)))
        cases += [(w8a8, kernels.AMX_INT8_ROWS, "int8_packed_gemm"),
                  (w8a8, kernels.AMX_INT8_ROWS + 1, "int8_packed_amx" if K % 64 == 0 else "int8_packed_gemm")]
    w8a16 = PackedW8A16Linear(W8A16Linear.from_float(torch.nn.Linear(64, 48)))
    cases += [(w8a16, kernels.AMX_W8_PACKED_ROWS, "w8a16_packed_gemm"),
              (w8a16, kernels.AMX_W8_PACKED_ROWS + 1, "w8a16_packed_amx")]
    for layer, rows, kernel in cases:
        x = torch.randn(rows, layer.in_features).bfloat16()
        calls.clear()
        weight = layer.weight.float() * (layer.scales.float()[:, None] if hasattr(layer, "scales") else 1)
        torch.testing.assert_close(layer(x).float(), x.float() @ weight.T + (0 if layer.bias is None else
                                   layer.bias.float()), rtol=3e-2, atol=3e-2)
        assert [c for c in calls if c != "quantize_rows"] == [kernel]
