"""Shared fixtures: tiny seeded random-weight models saved as real HF directories."""

from __future__ import annotations

import pytest
import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
            bos_token_id=1, eos_token_id=2)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
}


def make_hf_model(arch: str, path, seed: int = 0, **overrides):
    """Save a random `transformers` model of `arch` to `path`; return the HF model (float32, eval)."""
    import transformers

    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random biases and norm weights too, so that every tensor is checked
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(path)
    return model


@pytest.fixture(params=sorted(ARCHS))
def tiny_hf(request, tmp_path):
    """(arch, directory, transformers model) for every supported architecture."""
    return request.param, tmp_path, make_hf_model(request.param, tmp_path)


def make_tokenizer(path, vocab_size: int = 120) -> None:
    """A small character-level BPE tokenizer (with <s>, </s> and a chat template) saved like an HF one."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    text = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "def f(x): return x + 1"] * 20
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))


@pytest.fixture
def tiny_dir(tmp_path):
    """A complete tiny model directory (weights, config, tokenizer), as `leanlm` loads from the zoo."""
    make_hf_model("llama", tmp_path)
    make_tokenizer(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model float32, tokenizer) of a tiny Llama with a 512-token context, shared by a test module."""
    from leanlm.models.loading import load_model
    from leanlm.tokenizer import Tokenizer

    path = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama", path, max_position_embeddings=512)
    make_tokenizer(path)
    return load_model(path, torch.float32), Tokenizer(path)
