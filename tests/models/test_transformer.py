import pytest
import torch

from leanlm.cache.static import StaticCache
from leanlm.errors import LeanLMError
from leanlm.models.config import ModelConfig
from leanlm.models.loading import leanlm_to_hf, load_model
from tests.conftest import make_hf_model


def test_logits_match_transformers(tiny_hf):
    arch, path, ref = tiny_hf
    model = load_model(path, torch.float32)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(17)[None].expand(2, -1)
    ours = model(tokens, positions)
    with torch.no_grad():
        theirs = ref(tokens).logits
    assert (ours - theirs).abs().max() < 1e-4
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_cached_decoding_equals_full_recompute(tiny_hf):
    _, path, _ = tiny_hf
    model = load_model(path, torch.float32)
    tokens = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    full = model(tokens, torch.arange(20)[None])
    cache = StaticCache(model.config, 1, 32, torch.float32)
    steps = [model(tokens[:, :12], torch.arange(12)[None], cache)]
    for t in range(12, 20):
        steps.append(model(tokens[:, t : t + 1], torch.tensor([[t]]), cache))
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_left_padded_batch_equals_single_rows(tmp_path):
    make_hf_model("qwen2", tmp_path)
    model = load_model(tmp_path, torch.float32)
    from leanlm.generation.decode import decode_step, prefill

    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    logits, cache = prefill(model, prompts, max_new=4)
    nxt = logits.argmax(-1)
    step = decode_step(model, cache, nxt)
    for i, p in enumerate(prompts):
        single, c1 = prefill(model, [p], max_new=4)
        assert torch.allclose(single[0], logits[i], atol=1e-5)
        assert torch.allclose(decode_step(model, c1, nxt[i : i + 1])[0], step[i], atol=1e-5)


def test_hf_names_round_trip(tmp_path):
    ref = make_hf_model("qwen2", tmp_path)
    model = load_model(tmp_path, torch.float32)
    ours = leanlm_to_hf(model)
    theirs = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_float32(tmp_path, dtype):
    make_hf_model("llama", tmp_path)
    tokens = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(9)[None]
    ref = load_model(tmp_path, torch.float32)(tokens, pos)
    low = load_model(tmp_path, dtype)(tokens, pos).float()
    assert (low - ref).abs().max() < 0.05 * ref.abs().max()


def test_unsupported_architecture_is_refused():
    with pytest.raises(LeanLMError, match="supported: llama, mistral, qwen2"):
        ModelConfig.from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_missing_config(tmp_path):
    with pytest.raises(LeanLMError, match="no config.json"):
        load_model(tmp_path)
