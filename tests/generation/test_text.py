import pytest
import torch

from leanlm.errors import LeanLMError
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.text import generate, stream
from leanlm.models.loading import load_model
from leanlm.tokenizer import Tokenizer


@pytest.fixture
def lm(tiny_dir):
    return load_model(tiny_dir, torch.float32), Tokenizer(tiny_dir)


def full_recompute_greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])
        ids.append(int(logits[0, -1].argmax()))
    return ids


def test_batch_of_different_lengths_equals_full_recompute(lm):
    model, tok = lm
    prompts = ["the quick brown fox", "hello", "def f(x): return x + 1 and more words"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for c in generate(model, tok, prompts, params):
        assert c.prompt_tokens + c.tokens == full_recompute_greedy(model, c.prompt_tokens, 8)
        assert c.finish_reason == "length"


def test_stream_equals_generate_and_seed_repeats(lm):
    model, tok = lm
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=3, ignore_eos=True)
    streamed = "".join(stream(model, tok, "hello world", params))
    assert streamed == generate(model, tok, "hello world", params)[0].text
    assert streamed == "".join(stream(model, tok, "hello world", params))


def test_stop_string_cuts_text(lm):
    model, tok = lm
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    text = generate(model, tok, "the quick", params)[0].text
    stop = text[3:5]
    cut = generate(model, tok, "the quick", SamplingParams(temperature=0, max_tokens=12, stop=(stop,), ignore_eos=True))[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    assert "".join(stream(model, tok, "the quick", SamplingParams(temperature=0, max_tokens=12, stop=(stop,), ignore_eos=True))) == cut.text


def test_eos_finishes_a_row(lm):
    model, tok = lm
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
    with torch.no_grad():
        model.lm_head.bias[2] = 1e4  # </s> always wins
    c = generate(model, tok, "hello", SamplingParams(temperature=0, max_tokens=10))[0]
    assert c.finish_reason == "stop" and c.tokens == [2] and c.text == ""


def test_chat_template_renders(lm):
    _, tok = lm
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s>user: hi</s><s>assistant:"


def test_prompt_longer_than_context_is_refused(lm):
    model, tok = lm
    with pytest.raises(LeanLMError, match="context window is 256"):
        generate(model, tok, "hello " * 300, SamplingParams(max_tokens=4))
