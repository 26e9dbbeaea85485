import torch

from leanlm.generation.compiled import CompiledDecoder
from leanlm.generation.decode import decode_step, prefill
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model


def test_compiled_decode_matches_eager_batched(tmp_path):
    """The static-shape compiled step (slot writes, masked full-cache attention) equals the eager step."""
    make_hf_model("qwen2", tmp_path)
    model = load_model(tmp_path, torch.float32)
    compiled = CompiledDecoder(model)
    for prompts in ([[5, 6, 7, 8, 9]], [[5, 6, 7, 8, 9], [10, 11]]):  # batch 1 (reduction GEMVs) and padded batch 2
        logits_e, cache_e = prefill(model, prompts, 6)
        logits_c, cache_c = prefill(model, prompts, 6)
        tok_e = tok_c = logits_e.argmax(-1)
        for _ in range(5):
            logits_e = decode_step(model, cache_e, tok_e)
            logits_c = compiled.decode_step(cache_c, tok_c)
            assert torch.allclose(logits_c, logits_e, atol=1e-4)
            tok_e, tok_c = logits_e.argmax(-1), logits_c.argmax(-1)


def test_compiled_generate_equals_eager(tiny_dir):
    from leanlm.generation.sampling import SamplingParams
    from leanlm.generation.text import generate
    from leanlm.tokenizer import Tokenizer

    model, tok = load_model(tiny_dir, torch.float32), Tokenizer(tiny_dir)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eager = generate(model, tok, ["hello world", "the quick brown fox"], params)
    compiled = generate(model, tok, ["hello world", "the quick brown fox"], params, compiled=CompiledDecoder(model))
    assert [c.tokens for c in compiled] == [c.tokens for c in eager]


def test_two_decoders_keep_their_own_graphs(tmp_path):
    """Equal shapes, different modules (float and int8 projections): each decoder still runs its own model."""
    from leanlm.compress.quant.rtn import quantize_decoder

    make_hf_model("llama", tmp_path)
    plain, quantized = load_model(tmp_path, torch.bfloat16), load_model(tmp_path, torch.bfloat16)
    quantize_decoder(quantized, "w8a16")
    for model in (plain, quantized, plain):  # the second plain decoder compiles anew and must not see the int8 one
        compiled = CompiledDecoder(model)
        logits, cache_e = prefill(model, [[5, 6, 7]], 4)
        _, cache_c = prefill(model, [[5, 6, 7]], 4)
        tok = logits.argmax(-1)
        assert torch.allclose(compiled.decode_step(cache_c, tok).float(), decode_step(model, cache_e, tok).float(),
                              atol=2e-2)


def test_later_steps_skip_dynamo_and_read_the_callers_cache(tmp_path):
    """After a shape's first step the compiled graph is called directly (Dynamo is not entered again), and each
    step reads and writes the cache it is given: two caches of one shape, stepped in turn, match eager."""
    make_hf_model("llama", tmp_path)
    model = load_model(tmp_path, torch.float32)
    compiled = CompiledDecoder(model)
    prompts = ([[5, 6, 7]], [[9, 10, 11]])
    eager = [prefill(model, p, 8) for p in prompts]
    caches = [prefill(model, p, 8)[1] for p in prompts]
    toks = [logits.argmax(-1) for logits, _ in eager]
    compiled.decode_step(caches[0], toks[0])  # compiles and captures the graph for this shape
    decode_step(model, eager[0][1], toks[0])

    def no_dynamo(*args):
        raise AssertionError("Dynamo entered after the first step")

    compiled.compiler._compiled = {key: no_dynamo for key in compiled.compiler._compiled}
    for _ in range(3):
        for i in (0, 1):
            logits_e, logits_c = decode_step(model, eager[i][1], toks[i]), compiled.decode_step(caches[i], toks[i])
            assert torch.allclose(logits_c, logits_e, atol=1e-4)
            toks[i] = logits_e.argmax(-1)
    assert all(c.length == e.length for c, (_, e) in zip(caches, eager))


def _double(model, x):
    return model(x) * 2


def test_step_compiler_compiles_more_shapes_than_dynamos_recompile_limit():
    """Each key gets its own compiled copy: the engine's 9 batch buckets once failed at Dynamo's limit of 8."""
    from leanlm.generation.compiled import StepCompiler

    model = torch.nn.Linear(4, 3)
    compiler = StepCompiler(model, _double)
    with torch.inference_mode():
        for rows in range(1, 11):
            x = torch.randn(rows, 4)
            assert torch.allclose(compiler((rows,), dict(x=x)), model(x) * 2, atol=1e-6)
