"""A model's cost, measured in a fresh process (`isolated(...)` runs `python -m leanlm.bench.cost JSON`), so that one
model's compiled graphs, allocator and threads never touch another's timing (optimize's sweep, `leanlm compare`).

Batch 1: `bench.latency.bench` on random tokens (TTFT of the prompt, median TPOT, MBU, prefill MFU, peak RSS).
Speculative decoding is exact (its output is the plain model's), so its cost is the plain TPOT divided by the
speedup measured A/B by bench.speculative: prompt lookup on input-grounded prompts, where copying from the prompt
can pay; a draft model on code prompts.
Concurrent: `concurrency` random-token requests through the serving engine at once, output tokens per second.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from leanlm.bench.latency import bench
from leanlm.bench.speculative import speculation
from leanlm.cache.int8 import Int8KVCache
from leanlm.cache.static import StaticCache
from leanlm.engine.llm import LLM
from leanlm.errors import LeanLMError
from leanlm.generation import compiled as compiled_step
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.speculative import resolve_k
from leanlm.generation.threads import pick_threads
from leanlm.models.loading import load


def measure(model: str, dtype: str, kv_cache: str, prompt_lookup: int, draft: str, compiled: bool, cpp_wrapper: bool,
            threads: int | None, prompt_tokens: int, new_tokens: int, concurrency: int) -> dict:
    if not cpp_wrapper:  # this process only: inductor's Python launcher (half the compile time; TPOT within noise)
        compiled_step.INDUCTOR_OPTIONS["cpu"] = {**compiled_step.INDUCTOR_OPTIONS["cpu"], "cpp_wrapper": False}
    net, tok = load(model, dtype, None, progress=False)
    pick_threads(net, threads)
    cache_cls = Int8KVCache if kv_cache == "int8" else StaticCache
    r = bench(net, model, prompt_tokens, new_tokens, 1, compiled=compiled, cache_cls=cache_cls).to_dict()
    if prompt_lookup or draft:
        draft_net = None
        if draft:
            draft_net, draft_tok = load(draft, dtype, None, progress=False)
            if not tok.same_vocabulary(draft_tok):
                raise LeanLMError(f"draft {draft} does not share {model}'s tokenizer")
        params = SamplingParams(temperature=0, max_tokens=new_tokens)
        spec = speculation(net, tok, params, resolve_k(net, draft_net, None), draft_net, prompt_lookup)
        r.update(speedup=spec["measured_speedup"], acceptance=spec["acceptance"],
                 tpot_ms=r["tpot_ms"] / spec["measured_speedup"], tokens_per_s=r["tokens_per_s"] * spec["measured_speedup"])
    if concurrency:
        r["throughput"] = _throughput(net, tok, kv_cache, concurrency, prompt_tokens, new_tokens, prompt_lookup)
    return r


def _throughput(net, tok, kv_cache: str, n: int, prompt_tokens: int, new_tokens: int, prompt_lookup: int) -> float:
    """Output tokens per second with `n` random-token requests in the engine at once (eager steps, greedy)."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, net.config.vocab_size, (n, prompt_tokens), generator=gen).tolist()
    llm = LLM(net, tok, quiet=True, max_num_seqs=n, kv_cache=kv_cache, prompt_lookup=prompt_lookup)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, progress=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, progress=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def isolated(what: str, **args) -> dict:
    """measure(**args) in a fresh process; a failure is one LeanLMError naming `what` and the child's last line."""
    proc = subprocess.run([sys.executable, "-m", "leanlm.bench.cost", json.dumps(args)], capture_output=True,
                          text=True)
    if proc.returncode:
        raise LeanLMError(f"timing {what} failed: {last_line(proc.stderr) or f'exit status {proc.returncode}'}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def last_line(text: str) -> str:
    """A child process's last non-blank line of output ("" when it wrote none): its error message."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


if __name__ == "__main__":
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
