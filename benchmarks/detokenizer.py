"""Detokenizer cost per generated token: re-decoding the whole output (before) vs the incremental window (now).

    python benchmarks/detokenizer.py [--model smollm2-135m] [--tokens 2048] [--repeats 5]

Feeds the first --tokens tokens of a real text (the built-in evaluation text) one by one, as a completion streams,
and times each `add`. Prints one table: microseconds per token over the first 256 tokens, the last 256 and all,
with and without a stop string (the hold-back check runs on every token), for each algorithm; each token's time
is its fastest of --repeats runs. Both algorithms must give the same text.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from leanlm.generation.text import Detokenizer
from leanlm.tokenizer import Tokenizer


class ReDecodeAll(Detokenizer):
    """BEFORE (the reference, kept here only): decode all output ids on every token, quadratic in output length."""

    def add(self, token: int, tokenizer: Tokenizer) -> str:
        if token in self.eos:
            self.ids.append(token)
            self.finish_reason = "stop"
            return self.flush(len(self.text))
        self.ids.append(token)
        self.text = tokenizer.decode(self.ids)
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.emitted - len(stop)))
            if at >= 0:
                self.text, self.finish_reason = self.text[:at], "stop"
                return self.flush(at)
        safe = len(self.text.rstrip("\ufffd"))
        for stop in self.stops:
            for n in range(min(len(stop) - 1, safe), 0, -1):
                if self.text[:safe].endswith(stop[:n]):
                    safe -= n
                    break
        return self.flush(safe)


def per_token_us(cls: type, tok: Tokenizer, ids: list[int], stops: tuple[str, ...], repeats: int) -> tuple[list, str]:
    """Each add's time in microseconds (fastest of `repeats` runs) and the streamed text."""
    best = [float("inf")] * len(ids)
    for _ in range(repeats):
        d, out = cls([], stops, set()), []
        for k, token in enumerate(ids):
            start = time.perf_counter()
            out.append(d.add(token, tok))
            best[k] = min(best[k], (time.perf_counter() - start) * 1e6)
        out.append(d.flush(len(d.text)))
    return best, "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from leanlm.models.zoo import DEFAULT_MODEL, resolve

    ap.add_argument("--model", default=DEFAULT_MODEL, help="zoo name or HF model directory")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from leanlm.eval.datasets import builtin_text

    tok = Tokenizer(resolve(args.model))  # pulls a zoo model on first use
    ids = tok.encode(builtin_text("evaluation"), add_special_tokens=False)[: args.tokens]
    tail = min(256, len(ids))
    table = Table(title=f"{args.model} tokenizer, {len(ids)}-token output: µs per `add` (fastest of {args.repeats})")
    for col in ("algorithm", "stop strings", f"first {tail}", f"last {tail}", "all", "last: before / now"):
        table.add_column(col, justify="left" if col in ("algorithm", "stop strings") else "right")
    for stops in ((), ("\n\nTHE END",)):
        runs = {}
        for name, cls in (("before: re-decode all", ReDecodeAll), ("now: incremental", Detokenizer)):
            print(f"timing {name}, {len(stops)} stop strings", file=sys.stderr, flush=True)
            runs[name], text = per_token_us(cls, tok, ids, stops, args.repeats)
            assert text == tok.decode(ids), f"{name} streamed a different text"
        last = {n: statistics.fmean(t[-tail:]) for n, t in runs.items()}
        for name, t in runs.items():
            ratio = f"{last['before: re-decode all'] / last[name]:.1f}x" if name.startswith("now") else ""
            table.add_row(name, repr(stops[0]) if stops else "none", f"{statistics.fmean(t[:tail]):.1f}",
                          f"{last[name]:.1f}", f"{statistics.fmean(t):.1f}", ratio)
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
