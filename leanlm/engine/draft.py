"""Draft-model speculation in the engine's steps (Leviathan et al., https://arxiv.org/abs/2211.17192): a small model
of the same tokenizer proposes k tokens for every decoding sequence, batched, before the target verifies them all in
one forward (the exact rejection rule in Engine._verify). The draft keeps its keys and values in a pool of its own,
indexed by the target's block tables, so the scheduler's block manager owns both."""

from __future__ import annotations

import torch

from leanlm.cache.paged import KVPool
from leanlm.cache.paged_attention import PagedStep
from leanlm.engine.sequence import Sequence
from leanlm.generation.grammar import mask_rows
from leanlm.generation.sampling import probabilities
from leanlm.models.transformer import Transformer


class Drafter:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int):
        self.model = model
        self.pool = KVPool(model.config, num_blocks, block_size, model.dtype, model.device)

    @torch.inference_mode()
    def draft(self, seqs: list[Sequence]) -> None:
        """Replace each sequence's placeholder proposal (its length is what the scheduler made room for) by drafted
        tokens, and keep the draft's distributions for a sampled sequence's verification (seq.draft_probs)."""
        k = max(len(s.proposal) for s in seqs)
        drafted = {id(s): [] for s in seqs}
        probs = {id(s): [] for s in seqs if not s.params.greedy}
        for j in range(k):
            active = [s for s in seqs if len(s.proposal) > j]
            # first the tokens the draft has not seen (the last one, more after an accepted proposal), then one each
            feeds = [s.token_ids[s.draft_computed:] if j == 0 else [drafted[id(s)][-1]] for s in active]
            starts = [s.draft_computed if j == 0 else len(s.token_ids) - 1 + j for s in active]
            order = sorted(range(len(active)), key=lambda i: len(feeds[i]) > 1)  # single tokens first
            active, feeds, starts = ([x[i] for i in order] for x in (active, feeds, starts))
            logits = self._forward(active, feeds, starts)  # [B, V]
            # a constrained sequence drafts only what its grammar allows after the tokens drafted so far
            mask_rows(logits, [(s.matcher, [i], ()) for i, s in enumerate(active) if s.matcher is not None])
            for s, row in zip(active, logits):
                if s.params.greedy:
                    token = int(row.argmax())
                else:
                    p = probabilities(row[None], s.params)[0]
                    token = int(torch.multinomial(p, 1, generator=s.generator))
                    probs[id(s)].append(p)
                drafted[id(s)].append(token)
                if s.matcher is not None:
                    s.matcher.accept(token)
        for s in seqs:
            s.proposal = drafted[id(s)]
            s.draft_probs = torch.stack(probs[id(s)]) if id(s) in probs else None  # [k, V]
            if s.matcher is not None:
                s.matcher.rollback(len(s.proposal))
            # computed: everything before the last token, then the proposal's tokens but its last
            s.draft_computed = len(s.token_ids) - 1 + len(s.proposal)

    def _forward(self, seqs: list[Sequence], feeds: list[list[int]], starts: list[int]) -> torch.Tensor:
        """The draft's logits after each sequence's fed tokens  # -> [B, V]"""
        dev = self.model.device
        tokens = [t for f in feeds for t in f]
        positions = [p for f, s in zip(feeds, starts) for p in range(s, s + len(f))]
        ends = torch.tensor([len(f) for f in feeds], device=dev).cumsum(0) - 1
        step = PagedStep(self.pool, [s.block_table for s in seqs], starts, [len(f) for f in feeds], dev)
        return self.model(torch.tensor([tokens], device=dev), torch.tensor([positions], device=dev), step,
                          rows=ends)[0].float()

    @staticmethod
    def rewind(seq: Sequence) -> None:
        """After verification: the draft's keys and values hold the accepted tokens, not the rejected ones."""
        seq.draft_computed = min(seq.draft_computed, len(seq.token_ids) - 1)
