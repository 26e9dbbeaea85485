"""TinyBERT's captured states and attention maps against the model's own computation, MiniLLM's teacher-mixed
sampler against full forwards, and both losses at their fixed points."""

from __future__ import annotations

import pytest
import torch

from leanlm.distillation.features import captured, mixed_samples, uniform_layer_map
from leanlm.distillation.trainer import DistillConfig, Trainer
from leanlm.errors import LeanLMError
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model

IDS = torch.randint(3, 128, (2000,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gqa")
    make_hf_model("llama", path, seed=0)
    return path


def _forward(model, ids):
    return model(ids, torch.arange(ids.shape[1])[None].expand_as(ids))


def test_captured_maps_give_the_attention_output_and_states_the_blocks_outputs(model_dir):
    model = load_model(model_dir, torch.float32)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    attn = model.layers[1].self_attn
    seen = {}
    hook = attn.o_proj.register_forward_pre_hook(lambda m, args: seen.__setitem__("out", args[0]))
    with captured(model, [0, 1]) as f, torch.no_grad():
        logits = _forward(model, ids)
    hook.remove()
    B, T = ids.shape
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    probs = f.scores[1].masked_fill(causal, float("-inf")).softmax(-1)  # [B, H, T, T]
    qkv = attn.qkv_proj(model.layers[1].input_layernorm(f.hidden[0])).view(B, T, -1, attn.head_dim)
    v = qkv[:, :, attn.n_heads + attn.n_kv :].transpose(1, 2).repeat_interleave(attn.n_heads // attn.n_kv, 1)
    torch.testing.assert_close((probs @ v).transpose(1, 2).reshape(B, T, -1), seen["out"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(model.logits(f.hidden[1]), logits)
    torch.testing.assert_close(f.embedding, model.embed_tokens(ids))
    assert not model.embed_tokens._forward_hooks  # the hooks are gone after the block


def test_uniform_layer_map_spreads_the_student_over_the_teacher():
    assert uniform_layer_map(4, 12) == (2, 5, 8, 11) and uniform_layer_map(2, 2) == (0, 1)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_mixed_samples_report_the_probability_they_were_drawn_with(model_dir, tmp_path, alpha):
    make_hf_model("llama", tmp_path, seed=3)
    student, teacher = load_model(tmp_path, torch.float32), load_model(model_dir, torch.float32)
    prefix = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    tokens, logp = mixed_samples(student, teacher, prefix, 6, alpha, torch.Generator().manual_seed(0))
    source = teacher if alpha == 1.0 else student  # the whole mass on one model: its own log-probabilities
    with torch.no_grad():
        full = _forward(source, torch.cat([prefix, tokens], 1)).log_softmax(-1)[:, 4:-1]
    torch.testing.assert_close(logp, full.gather(-1, tokens[..., None])[..., 0], atol=1e-4, rtol=1e-4)
    again = mixed_samples(student, teacher, prefix, 6, alpha, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again[0])


def test_tinybert_loss_is_zero_for_a_copy_of_the_teacher_and_refuses_other_heads(model_dir, tmp_path):
    teacher, student = load_model(model_dir, torch.float32), load_model(model_dir, torch.float32)
    config = DistillConfig(loss="tinybert", batch_size=2, seq_len=16, steps=1, autocast=False)
    trainer = Trainer(teacher, student, IDS, None, config)
    assert trainer.layer_map == (0, 1)
    assert trainer.loss(trainer.batch(0, 0)).item() < 1e-8
    other = tmp_path / "heads"
    make_hf_model("llama", other, num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(LeanLMError, match="heads"):
        Trainer(teacher, load_model(other, torch.float32), IDS, None, config)
    with pytest.raises(LeanLMError, match="layer_map"):
        Trainer(teacher, load_model(model_dir, torch.float32), IDS, None,
                DistillConfig(loss="tinybert", steps=1, seq_len=16, layer_map=(0, 5)))
