"""Scheduler: who runs in the next step. Every running sequence decodes one token; the rest of the token budget
goes to prompt chunks, so a long prompt never stalls the others (Orca's iteration-level scheduling, Sarathi's
chunked prefill). When blocks run out, the newest sequence is preempted and later computed again."""

from __future__ import annotations

from collections import deque

from leanlm.cache.paged import BlockManager, cdiv
from leanlm.engine.sequence import Sequence


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int = 256, max_num_batched_tokens: int = 1024):
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # a newly admitted prompt leaves this many blocks free for the running sequences to grow into
        self.watermark = max(1, blocks.num_blocks // 100)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to feed) for the next step: decodes (one token each, or with their proposal) first,
        then prompt chunks."""
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
        return batch

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
