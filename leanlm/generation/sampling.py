"""SamplingParams, the one function that turns logits into a next-token distribution, and per-row batched sampling."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from leanlm.errors import LeanLMError
from leanlm.generation.grammar import GrammarSpec

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 mean no truncation; seed makes sampling repeatable.

    max_tokens None means up to the end of the context window. repetition_penalty 1 means none (CTRL's, over prompt
    and output); presence_penalty and frequency_penalty 0 mean none (OpenAI's, over the output only: a seen token's
    logit less presence once plus frequency per occurrence); logit_bias adds to chosen ids' logits ({id: bias},
    bias in [-100, 100]); min_tokens holds off EOS and stop_token_ids; n is completions per prompt; logprobs None
    means none, k means the sampled token's log-probability plus the k most likely alternatives; prompt_logprobs k
    the same for every prompt token (the first has none); grammar (generation.grammar.GrammarSpec) constrains the
    output to a JSON schema, regex, choice or grammar (the engine masks the logits of every step).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int | None = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise LeanLMError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LeanLMError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise LeanLMError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens is not None and _integer("max_tokens", self.max_tokens) < 1:
            raise LeanLMError(f"max_tokens must be >= 1 (or None: to the end of the context), got {self.max_tokens}")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if self.seed is not None:
            object.__setattr__(self, "seed", _integer("seed", self.seed, "an int or None"))
        if not 0 <= _number("min_p", self.min_p) <= 1:
            raise LeanLMError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        penalty = _number("repetition_penalty", self.repetition_penalty)
        if not (penalty > 0 and math.isfinite(penalty)):
            raise LeanLMError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {penalty}")
        ids = self.stop_token_ids  # like stop: one id or any iterable of ids
        ids = tuple(ids) if isinstance(ids, Iterable) and not isinstance(ids, (str, bytes)) else (ids,)
        ids = tuple(_integer("stop_token_ids", i, "token ids (ints >= 0)") for i in ids)
        if any(i < 0 for i in ids):
            raise LeanLMError(f"stop_token_ids must be token ids >= 0, got {min(ids)} in {ids}")
        object.__setattr__(self, "stop_token_ids", ids)
        min_tokens = _integer("min_tokens", self.min_tokens)
        if min_tokens < 0 or self.max_tokens is not None and min_tokens > self.max_tokens:
            raise LeanLMError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {min_tokens}")
        object.__setattr__(self, "min_tokens", min_tokens)
        n = _integer("n", self.n)
        if n < 1:
            raise LeanLMError(f"n must be >= 1 (completions per prompt), got {n}")
        object.__setattr__(self, "n", n)
        for name in ("logprobs", "prompt_logprobs"):
            if (k := getattr(self, name)) is not None:
                k = _integer(name, k, f"None or an int in [0, {MAX_LOGPROBS}]")
                if not 0 <= k <= MAX_LOGPROBS:
                    raise LeanLMError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {k}")
                object.__setattr__(self, name, k)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= _number(name, getattr(self, name)) <= 2:
                raise LeanLMError(f"{name} must be in [-2, 2] (0 disables it), got {getattr(self, name)}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        bias = tuple(sorted((_integer("logit_bias token id", int(t) if isinstance(t, str) and t.isdigit() else t),
                             float(_number("logit_bias value", b))) for t, b in bias))
        if any(not -100 <= b <= 100 or t < 0 for t, b in bias):
            raise LeanLMError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain(self) -> bool:
        """Sampling that looks at this position's logits alone: no penalty, bias or logprobs (the engine's fast path
        and prompt lookup need it)."""
        return (self.repetition_penalty == 1 and not self.presence_penalty and not self.frequency_penalty
                and not self.logit_bias and self.logprobs is None)


def _integer(name: str, value, expected: str = "an int"):
    """value as an int; bools and floats are refused so that True or 2.5 are not silently read as 1 or 2."""
    if isinstance(value, bool):
        raise LeanLMError(f"{name} must be {expected}, got {value!r}")
    try:
        return operator.index(value)  # also takes numpy and torch integers
    except TypeError:
        raise LeanLMError(f"{name} must be {expected}, got {value!r}") from None


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LeanLMError(f"{name} must be a number, got {value!r}")
    return value


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's log-probability and the `k` most likely ids with theirs, most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # the token's place among all ids by probability (1: the most likely), when known


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Next-token distribution after temperature, top-k, min-p and top-p  # [..., V] -> [..., V] float32

    min-p: https://arxiv.org/abs/2407.01082
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0:
        # the cut scales with the top token's probability: a confident step keeps few tokens, a flat one many
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row  # [B, V] -> [B]"""
    if params.greedy:
        return logits.max(-1).indices  # argmax's first maximum, faster on CPU (see sample_rows)
    probs = probabilities(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                histories: list[list[int] | None],
                banned: list[Iterable[int] | None],
                outputs: list[list[int]] | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row, each row with its own parameters  # logits [B, V] -> B ids, B logprobs or None

    Row i: repetition penalty over histories[i] (prompt + output so far), presence and frequency penalties over
    outputs[i] (the output so far), logit bias, banned[i] set to -inf (ids outside [0, V) are ignored: they cannot
    be drawn anyway), then argmax if greedy, else temperature, top-k, min-p, top-p
    and a draw with generators[i] (None: torch's default generator). A seeded row draws the same whatever its
    neighbours. Rows that share temperature, top_k, top_p and min_p get their distribution in one batched call.
    Logprobs come from log_softmax of the raw logits, before any of that (as vLLM reports them by default).
    """
    if logits.dim() != 2 or not logits.shape[0] == len(params) == len(generators) == len(histories) == len(banned):
        raise ValueError(f"sample_rows needs logits [B, V] and B params, generators, histories and banned lists; got "
                         f"logits {tuple(logits.shape)} and {len(params)}, {len(generators)}, {len(histories)}, "
                         f"{len(banned)}")
    banned = [() if b is None else list(b) for b in banned]
    if not any(banned) and all(p.greedy and p.plain for p in params):
        # the engine's common step: one reduction, one sync. max().indices, not argmax: the same first maximum,
        # 4x faster on CPU ([256, 49152] bf16: 5.5 vs 23 ms)
        return logits.max(-1).indices.tolist(), [None] * len(params)
    x = _processed(logits, params, histories, banned, outputs or [[]] * len(params))
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        tokens[greedy] = x[greedy].max(-1).indices
    for rows in _groups(params).values():
        probs = probabilities(x[rows], params[rows[0]])  # [R, V]
        tokens[rows] = _draw(probs, [generators[i] for i in rows])
    ids = tokens.tolist()
    return ids, _logprobs(logits, params, ids)


def _processed(logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int] | None],
               banned: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    """Logits after the penalties, logit bias and banned ids, in float32  # [B, V] -> [B, V], never the caller's

    Repetition penalty (CTRL, https://arxiv.org/abs/1909.05858): for every id seen, a positive logit is divided by
    the penalty and a negative one multiplied, so either way the seen token becomes less likely. Presence and
    frequency penalties (OpenAI's): minus presence for an id the output holds, minus frequency per occurrence.
    """
    penalised = [i for i, p in enumerate(params)
                 if p.repetition_penalty != 1 and histories[i] is not None and len(histories[i])]
    counted = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty) and outputs[i]]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if not penalised and not counted and not biased and not any(banned):
        return logits.float()
    x = logits.to(torch.float32, copy=True)
    device = logits.device
    for i in counted:
        ids, counts = torch.tensor(outputs[i], dtype=torch.long).unique(return_counts=True)
        inside = ids < x.shape[-1]
        p = params[i]
        x[i, ids[inside].to(device)] -= (p.presence_penalty + p.frequency_penalty * counts[inside]).to(device)
    for i in biased:  # ids past the logits cannot be drawn anyway
        pairs = [(t, b) for t, b in params[i].logit_bias if t < x.shape[-1]]
        ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device)
        x[i, ids] += torch.tensor([b for _, b in pairs], device=device)
    if penalised:
        # one gather and one scatter for the whole batch; an id seen twice writes the same value twice
        seen = torch.cat([torch.as_tensor(histories[i], dtype=torch.long) for i in penalised]).to(device)
        counts = torch.tensor([len(histories[i]) for i in penalised])
        rows = torch.repeat_interleave(torch.tensor(penalised), counts).to(device)
        penalty = torch.repeat_interleave(torch.tensor([params[i].repetition_penalty for i in penalised]), counts)
        penalty = penalty.to(device)
        v = x[rows, seen]
        x[rows, seen] = torch.where(v > 0, v / penalty, v * penalty)
    if any(banned):
        rows = torch.tensor([i for i, b in enumerate(banned) for _ in b], dtype=torch.long)
        cols = torch.tensor([t for b in banned for t in b], dtype=torch.long)
        inside = (cols >= 0) & (cols < x.shape[-1])
        x[rows[inside].to(device), cols[inside].to(device)] = float("-inf")
    return x


def _groups(params: list[SamplingParams]) -> dict[tuple, list[int]]:
    """Sampled rows that share temperature, top_k, top_p and min_p, so each group is one probabilities() call."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if not p.greedy:
            groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p), []).append(i)
    return groups


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row  # [R, V] -> [R]; rows with their own generator draw alone, so their draw is theirs only."""
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    free = [j for j, g in enumerate(generators) if g is None]
    if free:
        out[free] = torch.multinomial(probs[free], 1).squeeze(-1)
    for j, g in enumerate(generators):
        if g is not None:
            out[j] = torch.multinomial(probs[j:j + 1], 1, generator=g)[0, 0]
    return out


def _logprobs(logits: torch.Tensor, params: list[SamplingParams], ids: list[int]) -> list[TokenLogprobs | None]:
    """TokenLogprobs for the rows that asked, from the raw logits  # [B, V] -> B entries, None where not asked"""
    out: list[TokenLogprobs | None] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return out
    rows = token_logprobs(logits[want], [ids[i] for i in want], max(params[i].logprobs for i in want))
    for i, row in zip(want, rows):
        out[i] = replace(row, top=row.top[: params[i].logprobs])
    return out


def token_logprobs(logits: torch.Tensor, ids: list[int], k: int, ranks: bool = False) -> list[TokenLogprobs]:
    """Each row's id: its log-probability, the k most likely ids with theirs, and with ranks=True its rank (1 + the
    ids more likely)  # logits [R, V] raw, R ids -> R entries"""
    lp = logits.float().log_softmax(-1)  # [R, V]
    chosen = lp.gather(-1, torch.tensor(ids, device=lp.device)[:, None])  # [R, 1]
    top_v, top_i = (x.tolist() for x in lp.topk(min(k, lp.shape[-1]), dim=-1))  # [R, k], sorted
    rank = (lp > chosen).sum(-1).add(1).tolist() if ranks else [None] * len(ids)
    return [TokenLogprobs(t, c, list(zip(i, v)), r) for t, c, i, v, r in zip(ids, chosen[:, 0].tolist(), top_i, top_v,
                                                                           rank)]
