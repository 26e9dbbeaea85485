"""Prompt compression: the pure pieces against their definitions, then the whole pipeline on a tiny model."""

import itertools
import math
import re

import pytest
import torch

from leanlm.prompt.compressor import (
    PromptCompressor,
    _Stream,
    budget,
    coarse_select,
    cumulative,
    forced_chars,
    graded_rates,
    join,
    plan,
    quota,
    select,
    selective_context,
    split_units,
    words,
)
from leanlm.errors import LeanLMError


def test_split_units_tiles_the_text_into_paragraphs_and_long_ones_into_lines():
    text = "A.\nsays one\n\nB.\nsays two\nand more\n\n\nC. last"
    units = split_units(text, lambda s: len(s.split()))
    assert "".join(units) == text
    assert units == ["A.\nsays one\n\n", "B.\nsays two\nand more\n\n\n", "C. last"]
    lines = split_units(text, lambda s: len(s.split()), max_tokens=4)
    assert "".join(lines) == text and "B.\n" in lines and "and more\n" in lines
    # short units take in the next ones until they hold min_tokens, never past max_tokens
    merged = split_units(text, lambda s: len(s.split()), min_tokens=4)
    assert merged == ["A.\nsays one\n\nB.\nsays two\nand more\n\n\n", "C. last"]
    assert split_units(text, lambda s: len(s.split()), max_tokens=5, min_tokens=4) == [
        "A.\nsays one\n\n", "B.\nsays two\nand more\n\n\n", "C. last"]  # 3 + 5 words would pass max_tokens


def test_budget_gives_the_context_what_the_fixed_parts_leave():
    assert budget((10, 100, 20), 60) == (10, 30, 20)
    assert budget((10, 100, 20), 60, instruction_rate=0.5, question_rate=0.5) == (5, 45, 10)
    with pytest.raises(LeanLMError, match="no room for the context"):
        budget((10, 100, 20), 30)


def test_coarse_select_keeps_the_best_units_until_the_budget_is_reached():
    assert coarse_select([1.0, 5.0, 3.0, 5.0], [10, 10, 10, 10], 15) == [False, True, False, True]
    assert coarse_select([1.0, 5.0, 3.0], [10, 10, 10], 0) == [False, False, False]
    assert coarse_select([2.0, 1.0], [5, 5], 100) == [True, True]
    assert coarse_select([1.0, 5.0, 3.0], [10, 10, 10], 15, must=[True, False, False]) == [True, True, False]


def test_graded_rates_step_linearly_by_rank_and_hold_the_budget():
    rates = graded_rates([10, 10, 10], [1.0, 3.0, 2.0], 15, 0.2)  # ranks 2, 0, 1: level 0.5 -/+ 0.2
    assert rates == pytest.approx([0.3, 0.7, 0.5])
    rates = graded_rates([10, 30, 20], [5.0, 1.0, 3.0], 30, 0.6)  # clipped at 1 and 0, the level moves to hold 30
    assert all(0 <= r <= 1 for r in rates) and rates[0] == 1.0 and rates[0] - rates[2] <= 0.6 + 1e-9
    assert sum(n * r for n, r in zip([10, 30, 20], rates)) == pytest.approx(30, abs=1e-6)
    assert graded_rates([10, 20], [1.0, 2.0], 15, 0.0) == pytest.approx([0.5, 0.5])


@pytest.mark.parametrize("seed", range(5))
def test_plan_keeps_each_part_at_its_rate_and_the_total_exactly(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (6,), generator=g).tolist()
    rates = torch.rand(6, generator=g).tolist()
    segments = plan(lengths, rates, 25)
    pieces = [p for s in segments for p in s]
    assert [lo for lo, _, _ in pieces] == sorted(lo for lo, _, _ in pieces)
    assert all(hi - lo <= 25 and 0 <= k <= hi - lo for lo, hi, k in pieces)
    assert sum(k for _, _, k in pieces) == round(sum(n * r for n, r in zip(lengths, rates)))
    offsets = [sum(lengths[:i]) for i in range(6)]
    for o, n, r in zip(offsets, lengths, rates):  # each part within one token of its own rate
        assert abs(sum(k for lo, hi, k in pieces if o <= lo < o + n) - r * n) <= 1
    assert cumulative(lengths, rates)(sum(lengths)) == sum(k for _, _, k in pieces)


def test_quota_keeps_a_segment_s_items_above_one_threshold_over_everything_seen():
    ones = torch.ones(10, dtype=torch.long)
    # a first segment alone: its share of the rate
    assert quota(torch.arange(10.0), ones, 10, 10, 20) == 5
    # a segment of surprises after a predictable one keeps more than its share, a predictable one less
    assert quota(torch.cat([torch.zeros(10), torch.ones(10)]), torch.ones(20, dtype=torch.long), 10, 10, 20) == 10
    assert quota(torch.cat([torch.ones(10), torch.zeros(10)]), torch.ones(20, dtype=torch.long), 10, 10, 20) == 0
    # items hold several tokens (words); the threshold counts tokens
    assert quota(torch.tensor([0.0, 5.0]), torch.tensor([4, 2]), 1, 3, 6) == 2
    # the rest of the budget stays reachable: all left must be kept, nothing left to keep
    assert quota(torch.zeros(10), ones, 10, 10, 10) == 10
    assert quota(torch.arange(10.0), ones, 10, 0, 30) == 0
    assert quota(torch.cat([torch.ones(10), torch.zeros(10)]), torch.ones(20, dtype=torch.long), 10, 12, 14) == 8


def test_select_keeps_forced_then_the_top_scores_with_earlier_first_on_ties():
    scores = torch.tensor([0.1, 0.9, 0.5, 0.9, 0.2])
    forced = torch.tensor([True, False, False, False, False])
    assert select(scores, 3, forced).tolist() == [True, True, False, True, False]
    assert select(scores, 1, forced).tolist() == [True, False, False, False, False]
    assert select(scores, 0, forced).tolist() == [True, False, False, False, False]  # forced beats the quota
    naive = torch.zeros(5, dtype=torch.bool)
    naive[sorted(range(5), key=lambda i: (-scores[i].item(), i))[:2]] = True
    assert select(scores, 2, torch.zeros(5, dtype=torch.bool)).equal(naive)


def test_forced_chars_cover_force_strings_numbers_and_identifiers():
    text = "call parse_line(x) at 10:30, fooBar and KEEP"
    mask = forced_chars(text, force=("KEEP",), numbers=True, identifiers=True)
    marked = {text[m.start():m.end()] for m in re.finditer(r"\S+", text) if all(
        mask[i] for i in range(m.start(), m.end()) if text[i].isalnum())}
    assert {"10:30,", "fooBar", "KEEP"} <= marked and "parse_line(x)" not in marked
    assert all(mask[text.index("parse_line"):text.index("parse_line") + 10])
    assert not any(forced_chars("plain words 12", numbers=False))


def test_words_start_at_whitespace():
    # tokens "the", " quick", "_fox", "  ran"
    assert words("the quick_fox  ran", [0, 3, 9, 13], [3, 9, 13, 18]) == [0, 1, 1, 2]


def test_join_never_glues_two_words_where_whitespace_was_dropped():
    pieces = ["were", " done", "\n", "Could", " tram", "mel", ",", " catch", "!"]
    assert join(pieces, [True, True, False, True, True, False, True, False, True]) == "were done Could tram,!"
    assert join(pieces, [True, False, False, True, False, False, False, True, False]) == "were Could catch"
    assert join(pieces, [True] * 9) == "".join(pieces)


def test_selective_context_keeps_whole_words_by_summed_information():
    info = torch.tensor([1.0, 2.0, 2.0, 0.5, 3.0])
    word_of = [0, 1, 1, 2, 3]  # word information: 1, 4, 0.5, 3
    keep = selective_context(info, word_of, 3, torch.zeros(5, dtype=torch.bool))
    assert keep.tolist() == [False, True, True, False, True]
    keep = selective_context(info, word_of, 1, torch.zeros(5, dtype=torch.bool))  # the 2-token word does not fit
    assert keep.tolist() == [False, False, False, False, True]
    forced = torch.tensor([False, False, False, True, False])
    assert selective_context(info, word_of, 3, forced).tolist() == [False, True, True, True, False]


# ---- on a tiny model ---------------------------------------------------------------------------------------------

TEXT = ("the quick brown fox jumps over the lazy dog. hello world, hello there.\n\n"
        "def f(x): return x + 1\n\nthe lazy dog sleeps 42 times over the fox.\n\n") * 3


@pytest.fixture(scope="module")
def compressor(tiny):
    return PromptCompressor(model=tiny)


def test_stream_scores_equal_a_full_forward_over_the_kept_prefix(tiny):
    """The cached, segment-by-segment scores are -log p of each token given exactly the kept tokens before it."""
    net, _ = tiny
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (30,)).tolist()
    stream = _Stream(net, 64)
    kept_all, got, want = [], [], []
    for a, b, keep in [(0, 10, [1, 0, 1, 1, 0, 0, 1, 0, 1, 1]), (10, 20, [0] * 10), (20, 30, [1] * 10)]:
        scores = stream.score(ids[a:b])
        with torch.no_grad():
            for j, t in enumerate(ids[a:b]):
                prefix = kept_all + ids[a:a + j]
                if not prefix:
                    want.append(math.inf)
                    continue
                logits = net(torch.tensor([prefix]), torch.arange(len(prefix))[None])[0, -1].float()
                want.append(-torch.log_softmax(logits, -1)[t].item())
        got += scores.tolist()
        kept = [t for t, k in zip(ids[a:b], keep) if k]
        stream.commit(kept)
        kept_all += kept
    assert got[0] == math.inf == want[0]
    assert torch.allclose(torch.tensor(got[1:]), torch.tensor(want[1:]), atol=1e-4)


@pytest.mark.parametrize("method", ["llmlingua", "llmlingua-adaptive", "selective", "random"])
@pytest.mark.parametrize("rate", [0.3, 0.5, 0.7])
def test_meets_the_rate_and_is_deterministic(compressor, method, rate):
    method, _, quotas = method.partition("-")
    out = compressor.compress(TEXT, rate=rate, method=method, keep_numbers=False, quotas=quotas or "even")
    # random fragments of this toy character-level vocabulary re-tokenize into more pieces than real BPE's
    # (test_prompt_real holds every method to 10% on the zoo scorer)
    assert abs(out.compressed_tokens / out.original_tokens - rate) <= (0.15 if method == "random" else 0.1) * rate
    again = compressor.compress(TEXT, rate=rate, method=method, keep_numbers=False, quotas=quotas or "even")
    assert (again.text, again.compressed_tokens) == (out.text, out.compressed_tokens)


def test_single_token_selection_meets_the_rate_and_drops_pieces_of_words(compressor):
    words_out = compressor.compress(TEXT, rate=0.5, keep_numbers=False)
    tokens_out = compressor.compress(TEXT, rate=0.5, keep_numbers=False, whole_words=False)
    assert abs(tokens_out.compressed_tokens / tokens_out.original_tokens - 0.5) <= 0.05
    vocabulary = set(TEXT.split())
    assert set(words_out.text.split()) <= vocabulary  # whole words only
    assert not set(tokens_out.text.split()) <= vocabulary  # fragments


@pytest.mark.parametrize("method", ["llmlingua", "selective", "random"])
def test_forced_strings_and_numbers_survive(compressor, method):
    out = compressor.compress(TEXT, rate=0.4, method=method, force=("lazy",))
    assert out.text.count("42") == 3 and out.text.count("lazy") == TEXT.count("lazy")


def test_question_instruction_and_documents(compressor):
    docs = ["the quick brown fox jumps over the lazy dog " * 3, "hello world, hello there " * 3,
            "def f(x): return x + 1 " * 3]
    for method in ("llmlingua", "longllmlingua"):
        out = compressor.compress(docs, question="what does f return?", instruction="answer briefly", rate=0.4,
                                  method=method)
        assert out.text.startswith("answer briefly\n\n") and out.text.endswith("\n\nwhat does f return?")
        assert abs(out.compressed_tokens / out.original_tokens - 0.4) <= 0.04
    # graded by rank (longllmlingua's default): each unit keeps its rank's rate, the rate still met
    lengths = [len(compressor.tok.encode_spans(doc + "\n\n")[0]) for doc in docs]
    d = compressor.decide(docs, question="what does f return?", rate=0.6, method="longllmlingua", coarse=0,
                          dynamic=0.3, keep_numbers=False)
    ends = list(itertools.accumulate(lengths))
    shares = [d.keep[a:b].float().mean().item() for a, b in zip([0] + ends[:-1], ends)]
    context = round(0.6 * len(d.ids)) - (len(d.ids) - sum(lengths))  # the question is kept whole
    assert any(shares == pytest.approx(graded_rates(lengths, scores, context, 0.3), abs=1 / min(lengths))
               for scores in itertools.permutations(range(3)))  # one of the ranks' orders, each unit within a token


def test_a_tiny_or_empty_prompt_passes_through(compressor):
    for text in ["", "hello world", "the quick brown fox"]:
        out = compressor.compress(text, rate=0.3)
        assert out.text == text and out.method == "none"
    assert compressor.compress(TEXT, rate=1.0).text == TEXT


def test_bad_options_fail_clearly(compressor):
    with pytest.raises(LeanLMError, match="unknown compression method"):
        compressor.compress(TEXT, method="zip")
    with pytest.raises(LeanLMError, match="give one, or use llmlingua"):
        compressor.compress(TEXT, method="longllmlingua")
    with pytest.raises(LeanLMError, match="quotas must be"):
        compressor.compress(TEXT, quotas="fair")
    with pytest.raises(LeanLMError, match="rate must be in"):
        compressor.compress(TEXT, rate=1.5)
    with pytest.raises(LeanLMError, match="target_tokens must be positive"):
        compressor.compress(TEXT, target_tokens=0)
    with pytest.raises(LeanLMError, match="no room"):
        compressor.compress(TEXT, question="a long question " * 20, rate=0.05)


def test_bm25_against_its_formula():
    """Okapi BM25 by hand for a three-unit collection: idf log(1 + (N - n + 0.5) / (n + 0.5)), k1 1.2, b 0.75."""
    from leanlm.prompt.compressor import bm25

    units = ["the cat sat", "the dog ran far away", "a cat and a cat"]
    lengths, average = [3, 5, 5], 13 / 3
    idf = {"cat": math.log(1 + (3 - 2 + 0.5) / 2.5), "dog": math.log(1 + (3 - 1 + 0.5) / 1.5)}

    def term(f, length, word):
        return idf[word] * f * 2.2 / (f + 1.2 * (0.25 + 0.75 * length / average))

    expected = [term(1, lengths[0], "cat"), term(1, lengths[1], "dog"), term(2, lengths[2], "cat")]
    assert bm25(units, "Cat? DOG!") == pytest.approx(expected)
    assert bm25(units, "unicorn") == [0.0, 0.0, 0.0]
