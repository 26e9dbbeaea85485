import random

import pytest
import torch

from leanlm.errors import LeanLMError
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.text import Detokenizer, generate, stream
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


# Incremental detokenization: Detokenizer decodes a short window per token; its text must be the full decode.

MULTIBYTE = "naïve café, Ελληνικά, Привет! 日本語のテキスト、中文测试。emoji 😀👍🏽🇫🇷🧑‍💻 done"
MERGES = "  two leading spaces\n\n\tdef f(x):\n        return x + 1  # 1234567890\n\n\n3.14159 2718  end  \n"


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2-135m", marks=pytest.mark.real_model),
                                        pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.real_model)])
def any_tok(request, tmp_path_factory):
    """The tiny Metaspace (SentencePiece-like) tokenizer, SmolLM2's ByteLevel one, Qwen2.5's if already pulled."""
    from leanlm.fetch import cache_dir
    from leanlm.models.zoo import pull
    from tests.conftest import make_tokenizer

    if request.param == "tiny":
        path = tmp_path_factory.mktemp("tok")
        make_tokenizer(path)
    elif request.param == "smollm2-135m":
        path = pull(request.param, progress=False)
    else:  # half a gigabyte: used only where the zoo cache has it
        path = cache_dir() / "models" / request.param
        if not (path / "tokenizer.json").is_file():
            pytest.skip(f"{request.param} is not in the zoo cache")
    return Tokenizer(path)


def detokenize_checked(tok, ids, stops=()):
    """Feed ids one by one: at every step the text is the full decode so far and the emitted text a prefix of it."""
    d, out = Detokenizer([], stops, set()), ""
    for i, token in enumerate(ids):
        out += d.add(token, tok)
        if d.finish_reason:
            return out, d
        full = tok.decode(ids[: i + 1])
        assert d.text == full
        assert full.startswith(out)
        if not stops:
            assert out == full.rstrip("\ufffd")  # everything but an incomplete character
    out += d.flush(len(d.text))
    assert out == d.text == tok.decode(ids)
    return out, d


@pytest.mark.parametrize("text", [MULTIBYTE, MERGES])
def test_incremental_text_equals_full_decode(any_tok, text):
    ids = any_tok.encode(text, add_special_tokens=False)
    detokenize_checked(any_tok, ids)


def test_decoding_each_token_alone_would_fail(any_tok):
    """The texts above catch a naive detokenizer: split characters (ByteLevel), dropped spaces (Metaspace)."""
    ids = any_tok.encode(MULTIBYTE + MERGES, add_special_tokens=False)
    assert "".join(any_tok.decode([t]) for t in ids) != any_tok.decode(ids)


def test_multibyte_characters_split_across_tokens_wait(any_tok):
    ids = any_tok.encode(MULTIBYTE, add_special_tokens=False)
    if not any(any_tok.decode(ids[:i]).endswith("\ufffd") for i in range(len(ids))):
        pytest.skip("this tokenizer has no byte tokens")  # the tiny one maps unknown characters to <unk>
    d = Detokenizer([], (), set())
    pieces = [d.add(t, any_tok) for t in ids]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == any_tok.decode(ids) == MULTIBYTE


def test_random_ids_decode_incrementally(any_tok):
    rng = random.Random(0)
    for _ in range(3):  # random ids: invalid UTF-8, special tokens, odd merges
        detokenize_checked(any_tok, [rng.randrange(any_tok.vocab_size) for _ in range(200)])


@pytest.mark.parametrize("stop", ["中文", "\n\n\n", "😀👍"])
def test_stop_string_over_multibyte_text(any_tok, stop):
    text = MULTIBYTE + MERGES
    ids = any_tok.encode(text, add_special_tokens=False)
    full = any_tok.decode(ids)
    if stop not in full:
        pytest.skip("the tiny tokenizer loses these characters")
    out, d = detokenize_checked(any_tok, ids, (stop,))
    assert d.finish_reason == "stop" and out == d.text == full[: full.index(stop)]


def test_each_token_decodes_a_window_not_the_whole_output(any_tok):
    """Constant work per token: the ids decoded for one token stay few however long the output grows (re-decoding
    everything made 2k tokens cost 100x what the first ones did)."""
    ids = any_tok.encode(MERGES * 40, add_special_tokens=False)[:1500]
    decoded = []

    class Counting:
        def decode(self, window, skip_special_tokens=True):
            decoded.append(len(window))
            return any_tok.decode(window, skip_special_tokens)

    d = Detokenizer([], (), set())
    text = "".join(d.add(t, Counting()) for t in ids) + d.flush(len(d.text))
    assert text == any_tok.decode(ids) and len(ids) > 1000
    assert max(decoded) <= 64  # a window: the tokens since the last whole character, and a few before
