"""Runner: one forward over the packed tokens of a step (prompt chunks and decode tokens of many sequences, no
padding) through the paged cache; returns the logits of the sequences that sample a token."""

from __future__ import annotations

import torch

from leanlm.cache.paged import KVPool
from leanlm.cache.paged_attention import PagedStep
from leanlm.engine.compiled import BUCKETS
from leanlm.engine.sequence import Sequence
from leanlm.models.transformer import Transformer


class Runner:
    """`compiled`: an engine.compiled.CompiledPagedDecoder for steps of decodes only (None: always eager)."""

    def __init__(self, model: Transformer, pool: KVPool, compiled=None):
        self.model, self.pool, self.compiled = model, pool, compiled

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """Feed each sequence its next n tokens; (the sequences that reach their last token, their logits [R, V])."""
        dev = self.model.device
        if self.compiled is not None and len(batch) <= BUCKETS[-1] and all(n == 1 for _, n in batch):
            seqs = [s for s, _ in batch]
            return seqs, self.compiled.run([s.block_table for s in seqs], [s.num_computed for s in seqs],
                                           [s.token_ids[-1] for s in seqs])
        tokens, positions, rows, sampling = [], [], [], []
        for seq, n in batch:
            begin = seq.num_computed
            tokens.extend(seq.token_ids[begin : begin + n])
            positions.extend(range(begin, begin + n))
            if begin + n == len(seq.token_ids):
                rows.append(len(tokens) - 1)
                sampling.append(seq)
        step = PagedStep(self.pool, [s.block_table for s, _ in batch], [s.num_computed for s, _ in batch],
                         [n for _, n in batch], dev)
        logits = self.model(torch.tensor([tokens], device=dev), torch.tensor([positions], device=dev), step,
                            rows=torch.tensor(rows, dtype=torch.long, device=dev))
        return sampling, logits[0]
