"""Engine: requests in, tokens out, many requests sharing each forward. A step is schedule -> run -> postprocess
(sample, append, detokenize, finish), over a paged KV cache that prompts with a common prefix share."""

from __future__ import annotations

import sys
import threading
import time

import torch

from leanlm.cache.paged import BlockManager, KVPool, cdiv
from leanlm.engine.compiled import CompiledPagedDecoder
from leanlm.engine.draft import Drafter
from leanlm.engine.runner import Runner
from leanlm.engine.scheduler import Scheduler
from leanlm.engine.sequence import CompletionOutput, Delta, RequestOutput, Sequence
from leanlm.errors import LeanLMError
from leanlm.generation.decode import check_fits
from leanlm.generation.grammar import GrammarCompiler, mask_rows
from leanlm.generation.sampling import SamplingParams, probabilities, sample_rows, token_logprobs
from leanlm.generation.speculative import LookupProposer, verify
from leanlm.generation.text import Detokenizer, encode_prompt, eos_ids
from leanlm.models.transformer import Transformer
from leanlm.tokenizer import Tokenizer


class Engine:
    """Not thread-safe: one thread adds, aborts and steps (engine.llm.AsyncLLM runs it on its own thread)."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, kv_cache_memory: int = 1 << 30,
                 block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int = 1024,
                 prefix_caching: bool = True, kv_cache_dtype: str = "auto", compile: bool = False,
                 deterministic: bool = False, prompt_lookup: int = 0, num_speculative: int = 4,
                 draft: Transformer | None = None):
        if kv_cache_dtype not in ("auto", "int8"):
            raise LeanLMError(f"kv_cache_dtype must be auto (the model dtype) or int8, got {kv_cache_dtype!r}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise LeanLMError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if draft is not None and prompt_lookup:
            raise LeanLMError("speculate with a draft model or by prompt lookup, not both")
        self.model, self.tokenizer = model, tokenizer
        int8 = kv_cache_dtype == "int8"
        per_block = KVPool.bytes_per_block(model.config, block_size, model.dtype, int8)
        if draft is not None:  # the budget holds both models' keys and values, block for block
            per_block += KVPool.bytes_per_block(draft.config, block_size, draft.dtype)
        self.pool = KVPool(model.config, kv_cache_memory // per_block, block_size, model.dtype, model.device, int8)
        self.drafter = Drafter(draft, self.pool.num_blocks, block_size) if draft is not None else None
        # the pool's last block belongs to no sequence: padded rows (compiled and deterministic steps) write there
        scratch, compiled = self.pool.num_blocks - 1, None
        self.blocks = BlockManager(scratch, block_size, prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens)
        if compile and (deterministic or not CompiledPagedDecoder.supports(self.pool)):
            why = "deterministic mode feeds fixed tiles" if deterministic else (
                "the int8 KV cache is quantized outside the graph" if self.pool.int8 else
                "the paged-attention kernel is unavailable (a CPU float32/bfloat16 model and a C++ compiler)")
            print(f"leanlm: warning: compile is off, steps run eager: {why}", file=sys.stderr)
        elif compile:
            compiled = CompiledPagedDecoder(model, self.pool, scratch)
        self.runner = Runner(model, self.pool, compiled, deterministic, scratch)
        self.eos = eos_ids(model, tokenizer)
        self.lookup = LookupProposer(ngram=prompt_lookup) if prompt_lookup else None
        self.num_speculative = num_speculative
        # speculation (prompt lookup or a draft): verifications, tokens proposed and accepted, accepted per position
        self.spec_drafts = self.spec_proposed = self.spec_accepted = 0
        self.spec_accepted_per_pos = [0] * num_speculative
        self.requests: dict[str, list[Sequence]] = {}
        self._grammars, self._grammar_lock = None, threading.Lock()

    def describe(self) -> str:
        """The KV pool in a line: blocks, tokens, bytes (what the budget bought)."""
        kind = "int8" if self.pool.int8 else str(self.pool.dtype).removeprefix("torch.")
        tokens = self.blocks.num_blocks * self.blocks.block_size
        return (f"KV cache: {self.blocks.num_blocks} blocks of {self.blocks.block_size} tokens = {tokens} tokens "
                f"({self.pool.nbytes / 2**30:.2f} GiB, {kind}); up to {self.scheduler.max_num_seqs} sequences, "
                f"{self.scheduler.max_num_batched_tokens} tokens per step")

    def make_request(self, request_id: str, prompt: str | list[int] | list[dict], params: SamplingParams,
                     chat: bool = False) -> list[Sequence]:
        """Tokenize and check a request (any thread; raises LeanLMError on bad input, changing nothing). The prompt:
        text (in the chat template with chat=True), token ids, or chat messages ([{"role", "content"}, ...])."""
        chat = chat or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict))
        if isinstance(prompt, str) or chat:
            ids = encode_prompt(self.tokenizer, prompt, chat)
        else:
            ids = list(prompt)
            vocab = self.model.config.vocab_size
            for t in ids:
                if not isinstance(t, int) or not 0 <= t < vocab:
                    raise LeanLMError(f"prompt token id {t!r} is not an integer in [0, {vocab})")
        max_tokens = check_fits(self.model, len(ids), params.max_tokens)
        if params.max_tokens is None:  # to the end of the context, as far as the KV cache holds one sequence
            max_tokens = max(1, min(max_tokens, self.capacity - len(ids)))
        need = cdiv(len(ids) + max_tokens, self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise LeanLMError(f"a request of {len(ids)} prompt + {max_tokens} new tokens needs {need} KV blocks; the "
                              f"KV cache holds {self.blocks.num_blocks}: give it more memory or ask for fewer tokens")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos)
        seqs = [Sequence(request_id, i, ids, params, max_tokens, stop_ids, Detokenizer(ids, params.stop, stop_ids))
                for i in range(params.n)]
        if params.grammar is not None:
            matcher = self.grammars().matcher(params.grammar, params.stop_token_ids)
            for seq in seqs:
                seq.matcher = matcher.fork()
        seqs[0].children = seqs[1:]
        return seqs

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler (generation.grammar), made on first use: reading the vocabulary takes
        0.2-1.3 s. Any thread (make_request runs off the server's event loop)."""
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, self.eos)
            return self._grammars

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
        return self.blocks.num_blocks * self.blocks.block_size

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[Delta]:
        self._propose()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        if self.drafter is not None and (speculating := [s for s, _ in batch if s.proposal]):
            self.drafter.draft(speculating)
        sampling, logits, prompt_rows = self.runner.run(batch)
        if prompt_rows:
            self._prompt_logprobs(prompt_rows, logits[len(logits) - sum(n for _, _, n in prompt_rows):])
        for seq, n in batch:
            if not seq.proposal:
                seq.num_computed += n
                self.blocks.commit(seq, seq.num_computed)
        starts = [0]
        for seq in sampling:
            starts.append(starts[-1] + 1 + len(seq.proposal))
        now, deltas = time.perf_counter(), []
        plain = [(seq, row) for seq, row in zip(sampling, starts) if not seq.proposal]
        if plain:
            seqs, rows = self._fork(plain)
            histories = [s.token_ids if s.params.repetition_penalty != 1 else None for s in seqs]
            picked = logits if rows == list(range(len(logits))) else logits[rows]  # no copy in the common case
            self._mask(picked, [(s, [i]) for i, s in enumerate(seqs) if s.matcher is not None])
            tokens, logprobs = sample_rows(picked, [s.params for s in seqs], [s.generator for s in seqs],
                                           histories, [s.banned() for s in seqs], [s.output_ids for s in seqs])
            deltas += [self._append(seq, [token], lp and [lp], now) for seq, token, lp in zip(seqs, tokens, logprobs)]
        speculating = [(seq, list(range(row, row + 1 + len(seq.proposal)))) for seq, row in zip(sampling, starts)
                       if seq.proposal]
        self._mask(logits, [(seq, rows) for seq, rows in speculating if seq.matcher is not None])
        for seq, rows in speculating:
            deltas.append(self._verify(seq, logits[rows[0] : rows[-1] + 1], now))
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

    def _verify(self, seq: Sequence, logits: torch.Tensor, now: float) -> Delta:
        """Accept the longest right prefix of the proposal and one more token  # logits [1 + k, V].
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
        delta = self._append(seq, proposal[:accepted] + [following], None, now)
        if self.drafter is not None:
            self.drafter.rewind(seq)
        return delta

    def _prompt_logprobs(self, prompt_rows: list[tuple[Sequence, int, int]], logits: torch.Tensor) -> None:
        """Each prompt token's log-probability given the ones before it, with the top alternatives
        # logits [sum of n, V]: for (seq, position, n), the rows at positions position .. position + n - 1"""
        at = 0
        for seq, position, n in prompt_rows:
            nxt = seq.prompt_ids[position + 1 : position + 1 + n]
            seq.prompt_logprobs += token_logprobs(logits[at : at + n], nxt, seq.params.prompt_logprobs, ranks=True)
            at += n

    def _fork(self, sampling: list[tuple[Sequence, int]]) -> tuple[list[Sequence], list[int]]:
        """(sequence, logits row) to sample; a request's other completions join once its prompt is computed,
        sharing its blocks and first logits."""
        seqs, rows, copies = [], [], []
        for seq, row in sampling:
            seqs.append(seq)
            rows.append(row)
            for child in seq.children:
                pairs = self.blocks.fork(seq, child)
                if pairs is None:  # no block for the copy: it computes its prompt itself (prefix cache helps)
                    self.scheduler.add(child)
                    continue
                copies += pairs
                child.num_computed = seq.num_computed
                self.scheduler.running.append(child)
                seqs.append(child)
                rows.append(row)
            seq.children = []
        self.pool.copy_blocks(copies)
        return seqs, rows

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list | None, now: float) -> Delta:
        """Add sampled tokens (several after an accepted proposal) until one finishes the sequence."""
        first = seq.first_token_time is None
        seq.first_token_time = seq.first_token_time or now
        text, added = "", []
        for token in tokens:
            seq.token_ids.append(token)
            added.append(token)
            text += seq.detokenizer.add(token, self.tokenizer)
            seq.finish_reason = seq.detokenizer.finish_reason
            if seq.matcher is not None and seq.finish_reason is None:
                seq.matcher.accept(token)  # allowed: the mask saw to it
                if seq.matcher.done:  # only an end of sequence could follow
                    seq.finish_reason = "stop"
                    text += seq.detokenizer.flush(len(seq.detokenizer.text))
            if seq.finish_reason is None and len(seq.output_ids) >= seq.max_tokens:
                seq.finish_reason = "length"
                text += seq.detokenizer.flush(len(seq.detokenizer.text))
            if seq.finished:
                break
        if logprobs is not None:
            seq.logprobs += logprobs
        self.blocks.commit(seq, min(seq.num_computed, len(seq.token_ids)))
        if seq.finished:
            self.scheduler.finish(seq)
            if all(s.finished for s in self.requests.get(seq.request_id, [])):
                del self.requests[seq.request_id]
        prompt_logprobs = seq.prompt_logprobs if first and seq.params.prompt_logprobs is not None else None
        return Delta(seq.request_id, seq.index, text, added, seq.finish_reason, logprobs, prompt_logprobs)


def request_output(seqs: list[Sequence]) -> RequestOutput:
    """A request's completions as they stand."""
    first = seqs[0]
    outputs = [CompletionOutput(s.index, s.detokenizer.text, s.output_ids, s.finish_reason,
                                s.logprobs if s.params.logprobs is not None else None) for s in seqs]
    ttft = first.first_token_time - first.arrival if first.first_token_time else None
    prompt_logprobs = first.prompt_logprobs if first.params.prompt_logprobs is not None else None
    return RequestOutput(first.request_id, first.prompt_ids, outputs, all(s.finished for s in seqs),
                         first.num_cached, {"ttft": ttft}, prompt_logprobs)
