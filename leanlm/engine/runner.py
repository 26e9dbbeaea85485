"""Runner: one forward over the packed tokens of a step (prompt chunks and decode tokens of many sequences, no
padding) through the paged cache; returns the logits of the sequences that sample a token."""

from __future__ import annotations

from typing import NamedTuple

import torch

from leanlm.cache.paged import KVPool
from leanlm.cache.paged_attention import PagedStep, paged_kernel
from leanlm.engine.scheduler import ScheduledBatch
from leanlm.engine.sequence import Sequence
from leanlm.errors import LeanLMError
from leanlm.models.transformer import Transformer

TILE = 16  # rows of every product in deterministic mode


class Forward(NamedTuple):
    """A step's forward: the sequences that reach their last token (they sample), the logits [R + P, V]: first
    their rows (one each, 1 + len(proposal) for a speculating one), then P rows of prompt positions whose next
    token's log-probability was asked for, and those as (sequence, first position, rows)."""
    sampling: list[Sequence]
    logits: torch.Tensor
    prompt_rows: list[tuple[Sequence, int, int]]


class Runner:
    """`compiled`: an engine.compiled.CompiledPagedDecoder for steps of decodes only (None: always eager).

    deterministic: a token's logits do not depend on what shares its step, how its prompt was chunked or whether
    it was verified speculatively. Two things make them depend on it in the normal path: a matrix product's
    library picks its reduction order by the number of rows (float32 GEMMs here: 1 row differs from 2, 2 from 16),
    and prompt chunks attend by SDPA, whose tiling follows the chunk length. Deterministic mode feeds every token
    as a single query through the paged-attention kernel (one fixed order per query) and runs the model on tiles of
    exactly TILE rows (padded; a product's row comes out the same at any position of a fixed-shape tile)."""

    def __init__(self, model: Transformer, pool: KVPool, compiled=None, deterministic: bool = False,
                 scratch: int | None = None):
        self.model, self.pool, self.compiled = model, pool, compiled
        self.deterministic, self.scratch = deterministic, scratch
        if deterministic and paged_kernel(pool) is None:
            raise LeanLMError("deterministic mode needs leanlm's paged-attention kernel: a CPU model (float32 or "
                              "bfloat16) and a C++ compiler to build the kernel")

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> Forward:
        """Feed each sequence its next n tokens, its keys and values written and read at the batch's block tables."""
        if self.deterministic:
            return self._run_tiles(batch)
        dev = self.model.device
        if self.compiled is not None and all(n == 1 for n in batch.counts) and self.compiled.takes(len(batch)):
            return Forward(batch.seqs, self.compiled.run(batch.block_tables, batch.starts,
                                                         [s.token_ids[-1] for s in batch.seqs]), [])
        tokens, positions = [], []
        for (seq, n), start in zip(batch, batch.starts):
            tokens.extend(seq.fed(n))
            positions.extend(range(start, start + n))
        sampling, rows, prompt_rows = _rows(batch)
        step = PagedStep(self.pool, batch.block_tables, batch.starts, batch.counts, dev)
        logits = self.model(torch.tensor([tokens], device=dev), torch.tensor([positions], device=dev), step,
                            rows=torch.tensor(rows, dtype=torch.long, device=dev))
        return Forward(sampling, logits[0], prompt_rows)

    def _run_tiles(self, batch: ScheduledBatch) -> Forward:
        """Every token a single query, TILE at a time; padding rows write the scratch block."""
        dev, pad = self.model.device, ([self.scratch], 0, 0)  # (block table, position, token)
        queries = []
        for (seq, n), table, start in zip(batch, batch.block_tables, batch.starts):
            queries += [(table, start + i, t) for i, t in enumerate(seq.fed(n))]
        sampling, rows, prompt_rows = _rows(batch)
        hidden = []
        for i in range(0, len(queries), TILE):
            tile = queries[i : i + TILE]
            tile += [pad] * (TILE - len(tile))
            tables, positions, tokens = zip(*tile)
            step = PagedStep(self.pool, list(tables), list(positions), [1] * TILE, dev)
            hidden.append(self.model.hidden(torch.tensor([tokens], device=dev), torch.tensor([positions], device=dev),
                                            step)[0])
        if not rows:  # only prompt chunks with more to come
            return Forward([], torch.empty(0), [])
        x = torch.cat(hidden)[rows]  # [R, hidden]
        x = torch.cat([x, x.new_zeros(-len(x) % TILE, x.shape[1])])
        logits = torch.cat([self.model.logits(x[i : i + TILE]) for i in range(0, len(x), TILE)])
        return Forward(sampling, logits[: len(rows)], prompt_rows)


def _rows(batch: ScheduledBatch) -> tuple[list[Sequence], list[int], list[tuple[Sequence, int, int]]]:
    """Which rows of the step's packed tokens need logits: the sampling sequences' rows, then the prompt rows whose
    log-probabilities were asked for; (sampling sequences, row indices, (sequence, first position, rows))."""
    sampling, rows, prompt, prompt_rows, end = [], [], [], [], 0
    for seq, n in batch:
        end += n
        if r := seq.rows(n):
            rows.extend(range(end - r, end))
            sampling.append(seq)
        if p := seq.prompt_logprob_rows(n):
            prompt.extend(range(end - n, end - n + p))
            prompt_rows.append((seq, seq.num_computed, p))
    return sampling, rows + prompt, prompt_rows
