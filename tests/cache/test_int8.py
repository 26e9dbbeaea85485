import pytest
import torch

from leanlm.cache.int8 import Int8KVCache, dequantize_per_token, quantize_per_token
from leanlm.cache.static import StaticCache
from leanlm.models.config import ModelConfig
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model


def config(head_dim: int = 16) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=head_dim, max_position=256)


def kv(T: int, seed: int, D: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, T, D, generator=g) * 3, torch.randn(2, 2, T, D, generator=g)  # [B, Hkv, T, D]


def test_quantize_handles_zero_vectors():
    q, s = quantize_per_token(torch.zeros(1, 2, 3, 8))
    assert q.dtype == torch.int8 and not q.any() and torch.isfinite(s).all()
    assert not dequantize_per_token(q, s, torch.float32).any()


def test_matches_static_cache_within_int8_error():
    cfg, pad = config(), torch.tensor([0, 3])
    ref = StaticCache(cfg, 2, 12, torch.float32, pad=pad)
    ours = Int8KVCache(cfg, 2, 12, torch.float32, pad=pad)
    stored_k, stored_v = [], []
    for step, T in enumerate([5, 1, 1, 3]):  # a prefill, two decode steps, a speculative chunk
        mask_ref, causal_ref = ref.attention_mask(T)
        mask, causal = ours.attention_mask(T)
        assert causal == causal_ref and torch.equal(mask, mask_ref)
        k, v = kv(T, step)
        stored_k.append(k), stored_v.append(v)
        for layer in range(cfg.num_layers):
            k_ref, v_ref = ref.update(layer, k, v)
            k_all, v_all = ours.update(layer, k, v)
            assert k_all.shape == k_ref.shape and v_all.shape == v_ref.shape and k_all.dtype == torch.float32
        ref.advance(T), ours.advance(T)
        assert ours.length == ref.length
    end = ours.length
    for x, deq, scale in [(torch.cat(stored_k, 2), k_all, ours.k_scale[1][:, :, :end]),
                          (torch.cat(stored_v, 2), v_all, ours.v_scale[1][:, :, :end])]:
        assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / 127)
        assert ((deq - x).abs() <= scale / 2 * (1 + 1e-5)).all()
    ours.truncate(7), ref.truncate(7)
    assert ours.length == 7 and torch.equal(ours.attention_mask(2)[0], ref.attention_mask(2)[0])
    with pytest.raises(ValueError, match="KV cache full"):
        ours.update(0, *kv(6, 9))


def test_returns_model_dtype():
    cache = Int8KVCache(config(), 2, 4, torch.bfloat16)
    k, v = cache.update(0, *(t.bfloat16() for t in kv(2, 0)))
    assert k.dtype == v.dtype == torch.bfloat16 and cache.k[0].dtype == torch.int8


def greedy(model, cache_cls, steps: int = 16):
    """Left-padded batch of 2: prefill, then greedy decode; logits [B, steps + 1, V], tokens [B, steps]."""
    prompt = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(4))
    pad = torch.tensor([0, 3])
    cache = cache_cls(model.config, 2, 10 + steps, torch.float32, pad=pad)
    logits = [model(prompt, (torch.arange(10)[None] - pad[:, None]).clamp(min=0), cache)[:, -1]]
    tokens = []
    for _ in range(steps):
        tokens.append(logits[-1].argmax(-1))
        positions = torch.full((2, 1), cache.length) - pad[:, None]
        logits.append(model(tokens[-1][:, None], positions, cache)[:, -1])
    return torch.stack(logits, 1), torch.stack(tokens, 1)


def test_tiny_model_tracks_static_cache(tmp_path):
    make_hf_model("llama", tmp_path)
    model = load_model(tmp_path, torch.float32)
    with torch.no_grad():
        ref_logits, ref_tokens = greedy(model, StaticCache)
        logits, tokens = greedy(model, Int8KVCache)
    assert torch.equal(tokens, ref_tokens)
    # measured: max abs diff 1.7e-3 on logits of magnitude 1.1 (0.15%)
    assert (logits - ref_logits).abs().max() < 0.02 * ref_logits.abs().max()


def test_nbytes_is_int8_plus_scales():
    cfg = config(head_dim=64)
    ours = Int8KVCache(cfg, 2, 100, torch.bfloat16)
    bf16 = StaticCache(cfg, 2, 100, torch.bfloat16).nbytes
    scales = 2 * cfg.num_layers * 2 * cfg.num_kv_heads * 100 * 4  # k and v, float32, one per (token, head)
    assert ours.nbytes == bf16 // 2 + scales
    assert 0.5 <= ours.nbytes / bf16 <= 0.55  # 68 bytes per (token, head) vs 128
    assert 0.25 <= ours.nbytes / StaticCache(cfg, 2, 100, torch.float32).nbytes <= 0.275


def test_generation_with_the_int8_cache(tiny_dir):
    from leanlm.generation.compiled import CompiledDecoder
    from leanlm.generation.sampling import SamplingParams
    from leanlm.generation.text import generate
    from leanlm.tokenizer import Tokenizer

    model, tok = load_model(tiny_dir, torch.float32), Tokenizer(tiny_dir)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = generate(model, tok, ["hello world", "the quick"], params)
    int8 = generate(model, tok, ["hello world", "the quick"], params, cache_cls=Int8KVCache)
    assert [c.tokens for c in int8] == [c.tokens for c in plain]
    compiled = generate(model, tok, ["hello world", "the quick"], params, compiled=CompiledDecoder(model),
                        cache_cls=Int8KVCache)
    assert [c.tokens for c in compiled] == [c.tokens for c in plain]


def test_compiled_step_stores_and_reads_like_the_eager_int8_cache(tmp_path):
    """The compiled step's slot writes into an Int8KVCache: the same codes and scales, the same logits."""
    from leanlm.generation.compiled import CompiledDecoder
    from leanlm.generation.decode import decode_step, prefill
    from tests.conftest import make_hf_model

    make_hf_model("qwen2", tmp_path)
    model = load_model(tmp_path, torch.float32)
    compiled = CompiledDecoder(model)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]  # a padded batch
    logits, eager = prefill(model, prompts, 6, cache_cls=Int8KVCache)
    _, cache = prefill(model, prompts, 6, cache_cls=Int8KVCache)
    tok = logits.argmax(-1)
    for _ in range(4):
        expected, got = decode_step(model, eager, tok), compiled.decode_step(cache, tok)
        assert torch.allclose(got, expected, atol=1e-4)
        tok = expected.argmax(-1)
    n = eager.length
    for layer in range(model.config.num_layers):  # codes may round the other way on a last-bit difference
        for ours, theirs in ((cache.k, eager.k), (cache.v, eager.v)):
            assert (ours[layer][:, :, :n].int() - theirs[layer][:, :, :n].int()).abs().max() <= 1
        for ours, theirs in ((cache.k_scale, eager.k_scale), (cache.v_scale, eager.v_scale)):
            torch.testing.assert_close(ours[layer][:, :, :n], theirs[layer][:, :, :n], rtol=1e-5, atol=0)


def test_the_per_token_grid_is_the_quantization_primitives_one():
    """cache.int8 writes its grid itself (a cache must not import compress); it is the symmetric 8-bit grid of
    lowbit.primitives at token granularity, code for code."""
    from leanlm.lowbit.primitives import QuantSpec, compute_qparams, quantize

    spec = QuantSpec(bits=8, symmetric=True, granularity="token")
    x = torch.randn(3, 2, 17, 64) * torch.logspace(-3, 2, 64)
    x[0, 0, 0] = 0  # an all-zero vector
    scale, zero = compute_qparams(x, spec)
    q, s = quantize_per_token(x)
    assert torch.equal(q, quantize(x, scale, zero, spec)) and torch.equal(s, scale)
    assert torch.equal(quantize_per_token(x.bfloat16())[0], quantize(x.bfloat16(), *compute_qparams(x.bfloat16(), spec), spec))
