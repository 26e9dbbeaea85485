"""Scheduler: who runs in the next step, and which blocks hold their keys and values. Every running sequence decodes
one token; the rest of the token budget goes to prompt chunks, so a long prompt never stalls the others (Orca's
iteration-level scheduling, Sarathi's chunked prefill). When blocks run out, the newest sequence is preempted and
later computed again. The scheduler owns the block manager: the engine forks and commits through it, and the runner
reads the block tables from the batch it is given."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from leanlm.cache.paged import BlockManager, cdiv
from leanlm.engine.config import EngineConfig
from leanlm.engine.sequence import Sequence


@dataclass
class ScheduledBatch:
    """One step's work in the order the runner packs it (single tokens first): each sequence, the number of tokens
    it feeds from its first new position (start), and its block table: where the keys and values of positions
    [0, start + count) live in the pool."""
    seqs: list[Sequence]
    counts: list[int]
    starts: list[int]
    block_tables: list[list[int]]

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self):
        """(sequence, tokens it feeds)"""
        return zip(self.seqs, self.counts)

    @property
    def speculating(self) -> list[Sequence]:
        """The sequences that feed a proposal after their last token."""
        return [s for s in self.seqs if s.proposal]


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int):
        """num_blocks: the pool's. Its last block belongs to no sequence: padded rows (deterministic steps) and the
        steps that build compiled graphs write there (`scratch`)."""
        self.scratch = num_blocks - 1
        self.blocks = BlockManager(self.scratch, config.block_size, config.prefix_caching)
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.max_prefill_tokens = config.max_prefill_tokens
        # a newly admitted prompt leaves this many blocks free for the running sequences to grow into
        self.watermark = max(1, self.blocks.num_blocks // 100)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0

    @property
    def num_blocks(self) -> int:
        """Blocks the sequences share (the scratch block aside)."""
        return self.blocks.num_blocks

    @property
    def capacity(self) -> int:
        """Tokens the KV cache holds."""
        return self.blocks.num_blocks * self.blocks.block_size

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Who feeds what in the next step: decodes (one token each, or with their proposal) first, then prompt
        chunks (at most max_prefill_tokens of them beside decodes)."""
        batch, budget, preempted = [], self.max_num_batched_tokens, set()
        for seq in list(self.running):
            if seq.remaining != 1 or seq in preempted:  # prefilling, or preempted in this loop
                continue
            if seq.proposal and not (len(seq.proposal) < budget and self.blocks.grow(seq, len(seq.token_ids) +
                                                                                     len(seq.proposal))):
                seq.proposal = []  # no room to speculate: a plain decode
            while not self.blocks.grow(seq, len(seq.token_ids)):
                victim = self.running[-1]
                self.preempt(victim)
                preempted.add(victim)
                if victim is seq:
                    break
            else:
                batch.append((seq, 1 + len(seq.proposal)))
                budget -= batch[-1][1]
        batch.sort(key=lambda item: item[1] > 1)  # single tokens first: attention batches them (stable sort)
        if batch and self.max_prefill_tokens:  # prompt chunks beside decodes: a share that keeps their steps short
            budget = min(budget, self.max_prefill_tokens)
        for seq in self.running:  # prompts admitted in earlier steps continue, as far as blocks allow
            n = min(seq.remaining, budget, self.blocks.room(seq) - seq.num_computed)
            if seq.remaining > 1 and n > 0:
                self.blocks.grow(seq, seq.num_computed + n)
                batch.append((seq, n))
                budget -= n
        # admitted prompts get their blocks chunk by chunk: a new one must leave room for what they still need
        owed = sum(cdiv(len(s.token_ids), self.blocks.block_size) - len(s.block_table) for s in self.running
                   if s.remaining > 1)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            reserve = owed + (self.watermark if self.running else 0)
            if not self.blocks.allocate(seq, reserve, reuse=seq.prompt_logprob_rows(1) == 0):
                break
            self.waiting.popleft()
            seq.num_computed = seq.num_cached
            self.running.append(seq)
            n = min(seq.remaining, budget)
            self.blocks.grow(seq, seq.num_computed + n)  # allocate() saw room for the whole prompt
            owed += cdiv(len(seq.token_ids), self.blocks.block_size) - len(seq.block_table)
            batch.append((seq, n))
            budget -= n
        seqs = [s for s, _ in batch]
        return ScheduledBatch(seqs, [n for _, n in batch], [s.num_computed for s in seqs],
                              [s.block_table for s in seqs])

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """seq's first num_computed tokens have their keys and values in the pool: its full blocks among them become
        findable by later prompts (prefix caching)."""
        self.blocks.commit(seq, num_computed)

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """A completion of parent's request joins it once the prompt is computed: it shares parent's full blocks and
        runs from here, given the (src, dst) block copies its partial last block needs. None: no block is free for
        that copy, so the child waits and computes its prompt itself (the prefix cache helps)."""
        pairs = self.blocks.fork(parent, child)
        if pairs is None:
            self.add(child)
            return None
        child.num_computed = parent.num_computed
        self.running.append(child)
        return pairs

    def preempt(self, seq: Sequence) -> None:
        """Free its blocks; it waits at the front to be computed again (prompt and output so far)."""
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.num_computed = seq.draft_computed = 0
        seq.proposal = []  # proposed for a step it is no longer in
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence, wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
