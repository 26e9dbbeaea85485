"""Rotation: Q is orthogonal (a true Hadamard matrix where one is known), the rotated float model computes the same
function, an outlier channel is spread, and a rotated then W8A8 model saves, loads and runs."""

from __future__ import annotations

import json

import pytest
import torch

from leanlm import pipeline
from leanlm.compress.quant.rotate import rotate_mlp_inputs, rotate_model
from leanlm.errors import LeanLMError
from leanlm.lowbit.hadamard import OnlineRotation, hadamard, rotation
from leanlm.lowbit.linear import W8A16Linear
from leanlm.models.loading import load_model
from tests.compress.test_gguf_export import logits, source  # noqa: F401 (the fixture)


@pytest.mark.parametrize("n", [12, 64, 576, 896, 1536, 4864])
def test_hadamard_orders_of_the_zoo_models(n):
    H = hadamard(n)
    assert set(H.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(H @ H.T, n * torch.eye(n, dtype=torch.float64))


def test_rotation_is_orthogonal_with_or_without_a_hadamard_matrix():
    assert hadamard(100) is None  # 100 = 4 x 25: no construction here, a random orthogonal matrix instead
    for n in (100, 576):
        Q = rotation(n, seed=3)
        torch.testing.assert_close(Q @ Q.T, torch.eye(n, dtype=torch.float64))
    assert not torch.equal(rotation(64, seed=0), rotation(64, seed=1))  # the seed draws the signs


def test_an_outlier_channel_is_spread_over_all_channels():
    x = torch.randn(8, 576, dtype=torch.float64)
    x[:, 7] = 100.0  # one massive channel, as LLM residual streams have
    y = x @ rotation(576)
    ratio = lambda t: (t.abs().amax(-1) / t.square().mean(-1).sqrt()).max()  # noqa: E731
    assert ratio(x) > 20 and ratio(y) < 5
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))


def test_rotated_model_computes_the_same_function(source):  # noqa: F811
    arch, path = source
    model = load_model(path, torch.float32)
    with torch.no_grad():
        for block in model.layers:  # norms that are not all ones, so folding them matters
            block.input_layernorm.weight.uniform_(0.5, 1.5)
            block.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        model.norm.weight.uniform_(0.5, 1.5)
    ref = logits(model)
    tied = model.lm_head_is_embedding
    rotate_model(model)
    torch.testing.assert_close(logits(model), ref, atol=1e-4, rtol=1e-4)
    assert not model.lm_head_is_embedding and not model.config.tie_embeddings  # untied when it was tied
    assert all(torch.equal(b.input_layernorm.weight, torch.ones_like(b.input_layernorm.weight))
               for b in model.layers)
    if tied:
        assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)


def test_rotate_then_w8a8_saves_and_loads(source, tmp_path):  # noqa: F811
    arch, path = source
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("- method: rotate\n- {method: rtn, bits: 8, act_bits: 8}\n")
    built = pipeline.quantize(str(path), None, out=tmp_path / "out", recipe=recipe, dtype="float32")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    assert [s["method"] for s in json.loads((tmp_path / "out" / "quantization.json").read_text())["recipe"]] == \
        ["rotate", "rtn"]
    again = load_model(tmp_path / "out", torch.float32)
    torch.testing.assert_close(logits(again), logits(built.model))
    ref = logits(load_model(path, torch.float32))
    assert (logits(again) - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("n", [12, 64, 1536, 4864, 100])
def test_the_online_rotation_is_the_dense_product(n):
    """Kronecker factors (B^T on the left, Sylvester's H_p on the right, then the signs) where rotation(n) is a
    Hadamard matrix (1536 = 12 x 128, 4864 = 152 x 32), the dense matrix where it is not (100)."""
    x = torch.randn(3, 5, n, dtype=torch.float64)
    torch.testing.assert_close(OnlineRotation(n, seed=4)(x.float()).double(), x @ rotation(n, seed=4),
                               atol=1e-5, rtol=1e-5)


def test_online_rotation_keeps_the_function_then_w8a8_saves_loads_and_refuses_export(source, tmp_path):  # noqa: F811
    arch, path = source
    model = load_model(path, torch.float32)
    ref = logits(model)
    rotate_model(model)
    rotate_mlp_inputs(model, seed=2)
    torch.testing.assert_close(logits(model), ref, atol=1e-4, rtol=1e-4)
    assert all(b.mlp.rotation is not None for b in model.layers) and model.config.mlp_rotation == 2

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("- {method: rotate, online: true}\n- {method: rtn, bits: 8, act_bits: 8}\n")
    built = pipeline.quantize(str(path), None, out=tmp_path / "out", recipe=recipe, dtype="float32")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["leanlm_mlp_rotation"] == 2
    again = load_model(tmp_path / "out", torch.float32)
    assert again.config.mlp_rotation == 2 and again.layers[0].mlp.rotation is not None
    torch.testing.assert_close(logits(again), logits(built.model))
    assert (logits(again) - ref).abs().max() < 0.1 * ref.abs().max()
    from leanlm.compress.quant.export import export

    with pytest.raises(LeanLMError, match="rotated at run time"):
        export(again, tmp_path / "out", tmp_path / "ct")


def test_a_model_rotated_online_builds_its_compiled_engine_steps_first(source):  # noqa: F811
    """A server compiles its decode steps before any request (Engine.build_graphs), so nothing eager has made the
    rotation's matrices yet, and torch.compile cannot make them (a seeded generator; it traces through lru_cache):
    the step compiler makes them first. The compiled engine then decodes as the eager one."""
    from leanlm.engine import Engine, EngineConfig
    from leanlm.generation.sampling import SamplingParams
    from leanlm.tokenizer import Tokenizer

    _, path = source
    model = load_model(path, torch.float32)
    rotate_mlp_inputs(model, seed=2)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outputs = []
    for compile in (True, False):
        engine = Engine(model, Tokenizer(path), EngineConfig(block_size=4, kv_cache_memory=1 << 24, max_num_seqs=2,
                                                             compile=compile))
        if compile and engine.runner.compiled is None:
            pytest.skip("no paged-attention kernel here")
        engine.build_graphs()
        seqs = [engine.add_request(str(i), p, params)[0] for i, p in enumerate([[5, 9, 11, 3], [7, 2, 8, 8, 4]])]
        while engine.has_work:
            engine.step()
        outputs.append([s.output_ids for s in seqs])
    assert outputs[0] == outputs[1]


def test_smoothing_and_neuron_pruning_leave_a_rotated_mlp_input_alone(source, tmp_path):  # noqa: F811
    """SmoothQuant and AWQ fold down_proj's scale into up's rows, which a run-time rotation sits behind: SmoothQuant
    skips down_proj (the recipe still runs and keeps the function), neuron pruning refuses."""
    arch, path = source
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("- {method: rotate, online: true}\n- {method: smoothquant, alpha: 0.5}\n")
    built = pipeline.quantize(str(path), None, out=tmp_path / "sq", recipe=recipe, dtype="float32", samples=4,
                              seq_len=16)
    ref = logits(load_model(path, torch.float32))
    assert (logits(built.model) - ref).abs().max() < 0.1 * ref.abs().max()
    model = load_model(path, torch.float32)
    rotate_mlp_inputs(model, seed=2)
    from leanlm.compress.sparse.structured import Neurons, prune_neurons

    with pytest.raises(LeanLMError, match="prune first, then rotate"):
        prune_neurons(model, Neurons(intermediate_size=8), samples=torch.zeros(1, 4, dtype=torch.long))


def test_rotate_refuses_quantized_layers(source):  # noqa: F811
    _, path = source
    model = load_model(path, torch.float32)
    model.layers[0].mlp.down_proj = W8A16Linear.from_float(model.layers[0].mlp.down_proj)
    with pytest.raises(LeanLMError, match="before the quantization step"):
        rotate_model(model)
