"""Speculative decoding: a cheap proposer guesses K tokens, the target checks them all in one forward.

Two proposers share one verification loop:
- a draft model (Leviathan et al., https://arxiv.org/abs/2211.17192; Chen et al., https://arxiv.org/abs/2302.01318):
  it samples K tokens from its own distribution p; the target accepts token i with probability
  min(1, q(x)/p(x)) and, at the first rejection, samples from norm(max(0, q - p)). The output then follows
  the target's distribution q exactly;
- prompt lookup (LLMA, https://arxiv.org/abs/2304.04487): the K tokens that followed the latest earlier
  occurrence of the sequence's last n-gram in the prompt (or a reference text). The proposal is
  deterministic (p is one-hot), so the same rule accepts with probability q(x).
Greedy decoding accepts while the proposal equals the target's argmax, so its output is exactly the
target's own greedy output. Temperature, top-k and top-p shape p and q identically (sampling.probabilities).
Batch size is one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from leanlm.cache.static import StaticCache
from leanlm.errors import LeanLMError
from leanlm.generation.decode import check_fits
from leanlm.generation.sampling import SamplingParams, probabilities
from leanlm.models.transformer import Transformer
from leanlm.generation.threads import decode_step_seconds

PRIOR_ACCEPTANCE = 0.7  # used to pick K before any token was verified
MAX_K = 8


def predicted_speedup(a: float, k: int, c: float) -> float:
    """Expected speedup over plain decoding: (1 - a^(K+1)) / ((1 - a)(cK + 1)); a acceptance, c draft/target cost."""
    tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (c * k + 1)


def choose_k(c: float, a: float = PRIOR_ACCEPTANCE, k_max: int = MAX_K) -> int:
    """The K in 1..k_max that maximises the predicted speedup."""
    return max(range(1, k_max + 1), key=lambda k: predicted_speedup(a, k, c))


def verify(q: torch.Tensor, proposal: list[int], p: torch.Tensor | None, greedy: bool,
           generator: torch.Generator | None = None) -> tuple[int, int]:
    """Accept a prefix of the proposal; return (accepted count, the token that follows it).

    q [k+1, V] target distributions at each proposed position and one beyond; p [k, V] the draft's
    distributions, or None for a deterministic proposal.
    """
    for i, x in enumerate(proposal):
        if greedy:
            if x != int(q[i].argmax()):
                return i, int(q[i].argmax())
            continue
        px = 1.0 if p is None else float(p[i, x])
        if torch.rand((), generator=generator).item() >= min(1.0, float(q[i, x]) / px):
            drafted = torch.nn.functional.one_hot(torch.tensor(x), q.shape[-1]).float() if p is None else p[i]
            residual = (q[i] - drafted).clamp(min=0)
            residual = residual if residual.sum() > 0 else q[i]
            return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    k = len(proposal)
    return k, int(q[k].argmax()) if greedy else int(torch.multinomial(q[k], 1, generator=generator))


@dataclass
class SpecStats:
    """What a speculative run did; `acceptance` and `predicted_speedup()` feed the standard formula."""

    k: int
    tokens: int = 0  # tokens added by verification forwards (a run's first token comes from the prefill)
    target_forwards: int = 0
    draft_forwards: int = 0
    target_time: float = 0.0
    draft_time: float = 0.0
    reached: list[int] = field(default_factory=list)  # per draft position: proposals the target judged there
    accepted: list[int] = field(default_factory=list)  # per draft position: of those, accepted

    def __post_init__(self):
        self.reached = [0] * self.k
        self.accepted = [0] * self.k

    @property
    def acceptance(self) -> float:
        """a: the chance that a proposal the target judges is accepted (the formula's a)."""
        return sum(self.accepted) / max(1, sum(self.reached))

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / n if n else 0.0 for a, n in zip(self.accepted, self.reached)]

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / max(1, self.target_forwards)

    @property
    def cost_ratio(self) -> float:
        """c: time of one draft forward / time of one target (verification) forward."""
        if not self.draft_forwards:
            return 0.0
        return (self.draft_time / self.draft_forwards) / (self.target_time / max(1, self.target_forwards))

    @property
    def draft_share(self) -> float:
        return self.draft_time / max(1e-12, self.draft_time + self.target_time)

    def predicted_speedup(self) -> float:
        return predicted_speedup(self.acceptance, self.k, self.cost_ratio)

    def to_dict(self) -> dict:
        return {"k": self.k, "tokens": self.tokens, "acceptance": self.acceptance,
                "acceptance_per_position": self.acceptance_per_position, "tokens_per_target_forward": self.tokens_per_forward,
                "draft_time_share": self.draft_share, "target_time_share": 1 - self.draft_share,
                "cost_ratio": self.cost_ratio, "predicted_speedup": self.predicted_speedup()}


def _forward(model: Transformer, cache: StaticCache, tokens: list[int]) -> torch.Tensor:
    """Feed tokens after what the cache holds; logits for each of them  # [T, V]"""
    ids = torch.tensor([tokens], device=model.device)
    positions = torch.arange(cache.length, cache.length + len(tokens), device=model.device)[None]
    return model(ids, positions, cache)[0]


class DraftProposer:
    """Proposes K tokens sampled from a smaller model that shares the target's tokenizer."""

    def __init__(self, draft: Transformer, max_len: int, params: SamplingParams, generator=None):
        self.model, self.params, self.generator = draft, params, generator
        self.cache = StaticCache(draft.config, 1, max_len, draft.dtype, draft.device)
        self.seen = 0  # tokens of the sequence the draft cache holds

    @torch.inference_mode()
    def propose(self, seq: list[int], k: int, stats: SpecStats) -> tuple[list[int], torch.Tensor]:
        start = time.perf_counter()
        pending, tokens, dists = seq[self.seen :], [], []
        for _ in range(k):
            probs = probabilities(_forward(self.model, self.cache, pending)[-1:], self.params)[0]
            x = int(probs.argmax()) if self.params.greedy else int(torch.multinomial(probs, 1, generator=self.generator))
            tokens.append(x)
            dists.append(probs)
            pending = [x]
        self.seen = len(seq) + k - 1  # the last proposal is never fed
        stats.draft_forwards += k
        stats.draft_time += time.perf_counter() - start
        return tokens, torch.stack(dists)

    def rollback(self, length: int) -> None:
        """Forget everything after the first `length` tokens of the sequence."""
        self.seen = min(self.seen, length)
        self.cache.truncate(self.seen)


class LookupProposer:
    """Proposes the tokens that followed the latest earlier match of the sequence's last n-gram (n = N..1)."""

    def __init__(self, reference: list[int] | None = None, ngram: int = 3):
        if ngram < 1:
            raise LeanLMError(f"prompt lookup n-gram size must be >= 1, got {ngram}")
        self.reference, self.ngram = reference or [], ngram

    def propose(self, seq: list[int], k: int, stats: SpecStats) -> tuple[list[int], None]:
        for n in range(min(self.ngram, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            for source, end in ((seq, len(seq) - n), (self.reference, len(self.reference))):
                for start in range(end - n, -1, -1):  # latest match first
                    if source[start : start + n] == tail:
                        follow = source[start + n : start + n + k]
                        if follow:
                            return follow, None
        return [], None

    def rollback(self, length: int) -> None:
        pass


def resolve_k(target: Transformer, draft: Transformer | None, k: int | None) -> int:
    """K for a run: as given, or by default for a draft the K in 1..8 that maximises the predicted speedup
    with c measured by timing one decode step of each model and a prior acceptance of 0.7; for prompt
    lookup, 8 (its proposals cost nothing, c = 0)."""
    if k is not None and not 0 <= k <= 32:
        raise LeanLMError(f"--num-speculative must be between 0 and 32, got {k}")
    if draft is not None and draft.config.vocab_size != target.config.vocab_size:
        raise LeanLMError(f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
                          f"({target.config.vocab_size}); a draft must share the target's tokenizer")
    if k is not None:
        return k
    if draft is None:
        return MAX_K
    return choose_k(decode_step_seconds(draft) / decode_step_seconds(target))


def make_proposer(target: Transformer, params: SamplingParams, max_len: int, draft: Transformer | None = None,
                  ngram: int | None = None, k: int | None = None, reference: list[int] | None = None):
    """(proposer, K) for a run of at most max_len tokens; K from resolve_k."""
    k = resolve_k(target, draft, k)
    if draft is not None:
        return DraftProposer(draft, max_len + k + 1, params), k
    return LookupProposer(reference, ngram or 3), k


@torch.inference_mode()
def speculative_generate(target: Transformer, prompt: list[int], params: SamplingParams, proposer, k: int,
                         eos_ids: set[int] = frozenset(), stats: SpecStats | None = None) -> Iterator[list[int]]:
    """Yield the tokens each target forward adds (one or more), until EOS or params.max_tokens."""
    max_new = check_fits(target.config.max_position, len(prompt), params.max_tokens)
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    if isinstance(proposer, DraftProposer):
        proposer.generator = generator
    stats = stats if stats is not None else SpecStats(k)
    cache = StaticCache(target.config, 1, len(prompt) + max_new + k + 1, target.dtype, target.device)
    q = probabilities(_forward(target, cache, prompt)[-1:], params)
    first = int(q[0].argmax()) if params.greedy else int(torch.multinomial(q[0], 1, generator=generator))
    seq, produced = list(prompt) + [first], 1
    yield [first]
    while produced < max_new and (params.ignore_eos or seq[-1] not in eos_ids):
        room = min(k, max_new - produced - 1)  # the verification adds one token beyond the accepted ones
        proposal, p = proposer.propose(seq, room, stats) if room > 0 else ([], None)
        start = time.perf_counter()
        q = probabilities(_forward(target, cache, [seq[-1]] + proposal), params)
        n, nxt = verify(q, proposal, p, params.greedy, generator)
        stats.target_forwards += 1
        stats.target_time += time.perf_counter() - start
        for i in range(min(n + 1, len(proposal))):  # positions after a rejection are never judged
            stats.reached[i] += 1
            stats.accepted[i] += i < n
        new = proposal[:n] + [nxt]
        if not params.ignore_eos:
            cut = next((i for i, t in enumerate(new) if t in eos_ids), None)
            new = new if cut is None else new[: cut + 1]
        cache.truncate(len(seq) + n)  # keep seq[-1] and the accepted proposals
        proposer.rollback(len(seq) + n)
        seq += new
        produced += len(new)
        stats.tokens += len(new)
        yield new
