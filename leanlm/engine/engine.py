"""Engine: requests in, tokens out, many requests sharing each forward. A step reads schedule -> run -> sample ->
postprocess, over a paged KV cache that prompts with a common prefix share."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from leanlm.cache.int4 import Int4KVPool
from leanlm.cache.paged import KVPool
from leanlm.engine.compiled import CompiledPagedDecoder
from leanlm.engine.config import EngineConfig
from leanlm.engine.draft import Drafter
from leanlm.engine.intake import Intake, Limits
from leanlm.engine.postprocess import Sampled, append
from leanlm.engine.runner import Forward, Runner
from leanlm.engine.scheduler import ScheduledBatch, Scheduler
from leanlm.engine.sequence import CompletionOutput, Delta, RequestOutput, Sequence
from leanlm.errors import LeanLMError
from leanlm.generation.grammar import mask_rows
from leanlm.generation.sampling import SamplingParams, probabilities, sample_rows, token_logprobs
from leanlm.generation.speculative import LookupProposer, verify
from leanlm.generation.text import eos_ids
from leanlm.models.transformer import Transformer
from leanlm.runtime import parse_memory
from leanlm.tokenizer import Tokenizer


def _pool(model: Transformer, config: EngineConfig, memory: int, draft: Transformer | None) -> KVPool:
    """The KV pool `memory` bytes buy: the model's blocks in the configured storage, and as many of the draft's
    (its own dtype) block for block; an int4 pool also holds full-precision keys for one open block a sequence."""
    cfg, bs, dtype = model.config, config.block_size, model.dtype
    draft_bytes = KVPool.bytes_per_block(draft.config, bs, draft.dtype) if draft is not None else 0
    if config.kv_cache == "int4":
        return Int4KVPool.from_budget(cfg, memory, bs, dtype, model.device, config.max_num_seqs, draft_bytes)
    return KVPool.from_budget(cfg, memory, bs, dtype, model.device, config.int8_kv, draft_bytes)


@dataclass(frozen=True)
class EngineStats:
    """The engine's state a server reports (leanlm.serve.metrics): sequences running and waiting, KV-cache usage
    (0-1), prefix-cache queries and hits in tokens, preemptions, and speculation's verifications, tokens proposed,
    accepted, and accepted by position in the proposal."""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    spec_drafts: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


class Engine:
    """Not thread-safe: one thread adds, aborts and steps (engine.llm.AsyncLLM runs it on its own thread)."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: EngineConfig | None = None):
        """config: EngineConfig() when None; its draft, if any, a loaded model (LLM loads one by name)."""
        config = config if config is not None else EngineConfig()
        if config.draft_by_name:
            raise LeanLMError(f"Engine takes a loaded draft model, not {config.draft!r}: load it (leanlm.load), or "
                              "use LLM, which loads it by name")
        self.model, self.tokenizer, self.config, draft = model, tokenizer, config, config.draft
        self.pool = _pool(model, config, parse_memory(config.kv_cache_memory, model.device), draft)
        self.drafter = Drafter(draft, self.pool.num_blocks, config.block_size) if draft is not None else None
        self.scheduler = Scheduler(config, self.pool.num_blocks)
        self.runner = Runner(model, self.pool, self._compiled(), config.deterministic, self.scheduler.scratch)
        self.eos = frozenset(eos_ids(model, tokenizer))
        self.limits = Limits(model.config.vocab_size, model.config.max_position, self.eos, config.block_size,
                             self.scheduler.num_blocks)
        self.intake = Intake(tokenizer, self.limits)
        self.lookup = LookupProposer(ngram=config.prompt_lookup) if config.prompt_lookup else None
        self.num_speculative = config.num_speculative
        # speculation (prompt lookup or a draft): verifications, tokens proposed and accepted, accepted per position
        self.spec_drafts = self.spec_proposed = self.spec_accepted = 0
        self.spec_accepted_per_pos = [0] * config.num_speculative
        self.requests: dict[str, list[Sequence]] = {}

    def _compiled(self) -> CompiledPagedDecoder | None:
        """The compiled decode steps, when asked for and possible (else a warning: steps run eager)."""
        if not self.config.compile:
            return None
        dynamic = [type(m).__name__ for m in self.model.modules() if not getattr(m, "compilable", True)]
        if self.config.deterministic or dynamic or not CompiledPagedDecoder.supports(self.pool):
            why = "deterministic mode feeds fixed tiles" if self.config.deterministic else (
                f"{dynamic[0]} layers choose their work from the data (no fixed graph)" if dynamic else
                f"the {self.config.kv_cache} KV cache is quantized outside the graph" if self.config.kv_cache != "auto" else
                "the engine's compiled steps run on a CPU only (their paged attention is a CPU kernel)"
                if self.pool.k[0].device.type != "cpu" else
                "the paged-attention kernel is unavailable (a float32/bfloat16 model and a C++ compiler)")
            print(f"leanlm: warning: compile is off, steps run eager: {why}", file=sys.stderr)
            return None
        return CompiledPagedDecoder(self.model, self.pool, self.scheduler.scratch)

    def build_graphs(self, log=lambda text: None) -> None:
        """With compiled steps, compile every graph of up to max_num_seqs sequences now, not on first use: a server
        calls it before it answers /health, as vLLM compiles and captures before it reports ready."""
        if self.runner.compiled is not None:
            self.runner.compiled.build(self.config.max_num_seqs, log)

    @property
    def blocks(self):
        """The scheduler's block manager (cache.paged.BlockManager), to read its counters (usage, prefix-cache
        hits); blocks change hands only through the scheduler."""
        return self.scheduler.blocks

    def describe(self) -> str:
        """The KV pool in a line: blocks, tokens, bytes (what the budget bought)."""
        kind = str(self.pool.dtype).removeprefix("torch.") if self.config.kv_cache == "auto" else self.config.kv_cache
        c = self.config
        return (f"KV cache: {self.scheduler.num_blocks} blocks of {c.block_size} tokens = {self.capacity} tokens "
                f"({self.pool.nbytes / 2**30:.2f} GiB, {kind}); up to {c.max_num_seqs} sequences, "
                f"{c.max_num_batched_tokens} tokens per step")

    def make_request(self, request_id: str, prompt: str | list[int] | list[dict], params: SamplingParams,
                     chat: bool = False) -> list[Sequence]:
        """Tokenize and check a request (any thread; engine.intake.Intake.make)."""
        return self.intake.make(request_id, prompt, params, chat)

    def stats(self) -> EngineStats:
        """The counters a server reports (plain reads: any thread)."""
        s, blocks = self.scheduler, self.blocks
        return EngineStats(len(s.running), len(s.waiting), blocks.usage, blocks.queries, blocks.hits,
                           s.num_preemptions, self.spec_drafts, self.spec_proposed, self.spec_accepted,
                           tuple(self.spec_accepted_per_pos))

    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request made by make_request."""
        request_id = seqs[0].request_id
        if request_id in self.requests:
            raise LeanLMError(f"request id {request_id!r} is already running")
        self.requests[request_id] = seqs
        self.scheduler.add(seqs[0])

    def add_request(self, request_id: str, prompt, params: SamplingParams, chat: bool = False) -> list[Sequence]:
        seqs = self.make_request(request_id, prompt, params, chat)
        self.add(seqs)
        return seqs

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks (unknown or finished ids are ignored)."""
        for seq in self.requests.pop(request_id, []):
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)

    @property
    def capacity(self) -> int:
        """Tokens the KV cache holds."""
        return self.scheduler.capacity

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[Delta]:
        """schedule -> run -> sample -> postprocess: one forward for every scheduled sequence; what each completion
        gained."""
        self._propose()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.drafter is not None and (speculating := batch.speculating):
            self.drafter.draft(speculating)
        forward = self.runner.run(batch)
        self._computed(batch, forward)
        seqs, rows = self._fork(forward.sampling)
        return self.postprocess(self._sample(seqs, rows, forward.logits))

    def _computed(self, batch: ScheduledBatch, forward: Forward) -> None:
        """The fed tokens' keys and values are in the pool (a proposal's count once verified): their full blocks
        become findable; the prompt log-probabilities asked for are noted."""
        if forward.prompt_rows:
            rows = sum(n for _, _, n in forward.prompt_rows)
            self._prompt_logprobs(forward.prompt_rows, forward.logits[len(forward.logits) - rows :])
        for seq, n in batch:
            if not seq.proposal:
                seq.num_computed += n
                self.scheduler.commit(seq, seq.num_computed)

    def _fork(self, sampling: list[Sequence]) -> tuple[list[Sequence], list[list[int]]]:
        """Who samples, and from which rows of the logits (1 + len(proposal) for a speculating sequence): a request's
        other completions join once its prompt is computed, sharing its blocks and first logits."""
        seqs, rows, copies, row = [], [], [], 0
        for seq in sampling:
            seqs.append(seq)
            rows.append(list(range(row, row + 1 + len(seq.proposal))))
            row += 1 + len(seq.proposal)
            for child in seq.children:
                if (pairs := self.scheduler.fork(seq, child)) is not None:
                    copies += pairs
                    seqs.append(child)
                    rows.append(rows[-1])
            seq.children = []
        self.pool.copy_blocks(copies)
        return seqs, rows

    def _sample(self, seqs: list[Sequence], rows: list[list[int]], logits: torch.Tensor) -> list[Sampled]:
        """Each sequence's next tokens from its rows of the logits [R, V]; a proposal is verified."""
        plain = [(seq, r[0]) for seq, r in zip(seqs, rows) if not seq.proposal]
        speculating = [(seq, r) for seq, r in zip(seqs, rows) if seq.proposal]
        sampled = []
        if plain:
            ss, picked = [s for s, _ in plain], [r for _, r in plain]
            picked = logits if picked == list(range(len(logits))) else logits[picked]  # no copy in the common case
            self._mask(picked, [(s, [i]) for i, s in enumerate(ss) if s.matcher is not None])
            histories = [s.token_ids if s.params.repetition_penalty != 1 else None for s in ss]
            tokens, logprobs = sample_rows(picked, [s.params for s in ss], [s.generator for s in ss], histories,
                                           [s.banned() for s in ss], [s.output_ids for s in ss])
            sampled += [Sampled(seq, [token], lp and [lp], False) for seq, token, lp in zip(ss, tokens, logprobs)]
        self._mask(logits, [(seq, r) for seq, r in speculating if seq.matcher is not None])
        sampled += [Sampled(seq, self._verify(seq, logits[r[0] : r[-1] + 1]), None, True) for seq, r in speculating]
        return sampled

    def postprocess(self, sampled: list[Sampled]) -> list[Delta]:
        """Append each sequence's tokens (postprocess.append: detokenize, finish), make its computed blocks findable,
        and drop it once finished; the deltas, in order."""
        now, deltas = time.perf_counter(), []
        for seq, tokens, logprobs, verified in sampled:
            deltas.append(append(seq, tokens, logprobs, self.tokenizer, now))
            self.scheduler.commit(seq, min(seq.num_computed, len(seq.token_ids)))
            if verified and self.drafter is not None:
                self.drafter.rewind(seq)
            if seq.finished:
                self.scheduler.finish(seq)
                if all(s.finished for s in self.requests.get(seq.request_id, [])):
                    del self.requests[seq.request_id]
        return deltas

    @torch.inference_mode()  # the logits are inference tensors: changed in place only inside the mode
    def _mask(self, logits: torch.Tensor, constrained: list[tuple[Sequence, list[int]]]) -> None:
        """Structured outputs: each constrained sequence's disallowed tokens set to -inf in its rows, in place
        # logits [R, V]; constrained: (sequence, its rows: the next token's, then one per proposed token)"""
        mask_rows(logits, [(seq.matcher, rows, seq.proposal) for seq, rows in constrained])

    def _propose(self) -> None:
        """Prompt lookup: a decoding sequence proposes the tokens that followed the latest earlier match of its last
        n-gram (generation.speculative.LookupProposer); with a draft model, room for its proposal. Requests whose
        sampling looks at more than the logits of each position (penalties, logit bias, pending min_tokens,
        logprobs) decode plainly."""
        if self.lookup is None and self.drafter is None:
            return
        for seq in self.scheduler.running:
            p, room = seq.params, min(self.num_speculative, seq.max_tokens - len(seq.output_ids) - 1)
            eligible = seq.remaining == 1 and seq.num_computed > 0 and not seq.children and room > 0
            eligible = eligible and p.plain and len(seq.output_ids) >= p.min_tokens
            if self.drafter is not None:  # placeholders: the scheduler makes room, then the draft fills them
                seq.proposal = [0] * room if eligible else []
                continue
            seq.proposal = self.lookup.propose(seq.token_ids, room, None)[0] if eligible else []
            if seq.proposal and seq.matcher is not None:  # drafted tokens the grammar refuses are not worth a row
                seq.proposal = seq.proposal[: seq.matcher.validate(seq.proposal)]

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        """The longest right prefix of the proposal and one more token  # logits [1 + k, V].
        Greedy: while the proposal equals the argmax; sampled: the exact rejection rule (speculative.verify), against
        the draft's distributions (a lookup proposal is certain)."""
        proposal, seq.proposal = seq.proposal, []
        if seq.params.greedy:
            best = logits.max(-1).indices.tolist()
            accepted = next((i for i, (x, y) in enumerate(zip(proposal, best)) if x != y), len(proposal))
            following = best[accepted]
        else:
            accepted, following = verify(probabilities(logits, seq.params), proposal, seq.draft_probs, False,
                                         seq.generator)
        seq.num_computed += 1 + accepted  # the rejected proposals' keys and values are overwritten later
        self.spec_drafts += 1
        self.spec_proposed += len(proposal)
        self.spec_accepted += accepted
        for i in range(accepted):
            self.spec_accepted_per_pos[i] += 1
        return proposal[:accepted] + [following]

    def _prompt_logprobs(self, prompt_rows: list[tuple[Sequence, int, int]], logits: torch.Tensor) -> None:
        """Each prompt token's log-probability given the ones before it, with the top alternatives
        # logits [sum of n, V]: for (seq, position, n), the rows at positions position .. position + n - 1"""
        at = 0
        for seq, position, n in prompt_rows:
            nxt = seq.prompt_ids[position + 1 : position + 1 + n]
            seq.prompt_logprobs += token_logprobs(logits[at : at + n], nxt, seq.params.prompt_logprobs, ranks=True)
            at += n


def request_output(seqs: list[Sequence]) -> RequestOutput:
    """A request's completions as they stand."""
    first = seqs[0]
    outputs = [CompletionOutput(s.index, s.detokenizer.text, s.output_ids, s.finish_reason,
                                s.logprobs if s.params.logprobs is not None else None) for s in seqs]
    ttft = first.first_token_time - first.arrival if first.first_token_time else None
    prompt_logprobs = first.prompt_logprobs if first.params.prompt_logprobs is not None else None
    return RequestOutput(first.request_id, first.prompt_ids, outputs, all(s.finished for s in seqs),
                         first.num_cached, {"ttft": ttft}, prompt_logprobs)
