"""The server's automatic prompt compression on a real model, as a user runs it: `leanlm serve MODEL
--prepare-compression classifier` started cold, then long prompts sent through the official `openai` client with
and without `"leanlm": {"compress_prompt": {"auto": true, "rate": R}}`.

    python benchmarks/auto_compression.py [--model qwen2.5-coder-1.5b] [--lengths 128,256,512,1024,2048]
                                          [--rate 0.33] [--repeats 3]

Prints how long the server took to be ready (the model loaded, the classifier loaded or made, the break-even
measured), then for each prompt length (the served model's tokens: an excerpt of a play of the evaluation split and
a question) whether auto compressed it, the break-even length the server reported, the tokens the model read, and
the request's latency with max_tokens 1 (its time to first token, compression included) without and with auto:
the median of --repeats requests, each with a different excerpt so that the prefix cache helps none.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import httpx
from openai import OpenAI
from rich.console import Console
from rich.table import Table

from leanlm.bench.probe import device_name
from leanlm.bench.serve import LocalServer, free_port, leanlm_command
from leanlm.eval.datasets import EVALUATION_FILES, corpus_dir

QUESTION = "Who speaks first in this excerpt? Answer with the speaker's name."


def excerpts(server: str, lengths: list[int], repeats: int, rng: random.Random) -> dict[int, list[str]]:
    """`repeats` excerpts of each length in the served model's tokens (the server tokenizes and cuts them), each
    from its own random place in the plays."""
    plays = [(corpus_dir() / f).read_text() for f in EVALUATION_FILES]
    out = {}
    for n in lengths:
        out[n] = []
        for _ in range(repeats):
            text = rng.choice(plays)
            start = text.index("\n\n", rng.randrange(len(text) - 8 * n - 100)) + 2
            ids = httpx.post(server + "/tokenize", json={"prompt": text[start:start + 8 * n]}).json()["tokens"]
            out[n].append(httpx.post(server + "/detokenize", json={"tokens": ids[:n]}).json()["prompt"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--lengths", default="128,256,512,1024,2048")
    ap.add_argument("--rate", type=float, default=0.33, help="the share of the prompt's tokens to keep")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    port = free_port()
    command = leanlm_command("serve", args.model, "--port", str(port), "--served-model-name", "m",
                             "--prepare-compression", "classifier")
    start = time.perf_counter()
    with LocalServer(command, port, timeout=1800) as server:
        ready = time.perf_counter() - start
        print(f"ready after {ready:.1f} s", file=sys.stderr, flush=True)
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        texts = excerpts(server.url, lengths, 2 * args.repeats, random.Random(0))
        table = Table(title=f"{args.model} served, auto compression at rate {args.rate:g} (classifier), "
                            f"{device_name()}; server ready after {ready:.0f} s")
        for head in ("prompt tokens", "compressed", "break-even tokens", "tokens read with auto",
                     "latency s without", "latency s with auto", "speed-up"):
            table.add_column(head, justify="right")
        for n in lengths:
            plain, auto, read, compressed, pays = [], [], [], 0, None
            auto_options = {"compress_prompt": {"auto": True, "rate": args.rate, "question": QUESTION}}
            for i in range(args.repeats):
                for leanlm, times in ((None, plain), (auto_options, auto)):
                    text = texts[n][2 * i + (leanlm is not None)]
                    prompt = text if leanlm else text.rstrip("\n") + "\n\n" + QUESTION  # auto: the server adds it
                    t0 = time.perf_counter()
                    r = client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0,
                                                  extra_body={"leanlm": leanlm} if leanlm else None)
                    times.append(time.perf_counter() - t0)
                    if leanlm:
                        extra = r.usage.model_extra
                        read.append(r.usage.prompt_tokens)
                        compressed += extra["compressed_prompts"]
                        pays = extra["break_even_tokens"]
            a, b = statistics.median(plain), statistics.median(auto)
            table.add_row(str(n), f"{compressed} of {args.repeats}", str(pays), str(round(statistics.median(read))),
                          f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x")
            print(f"{n} tokens: {a:.3f} -> {b:.3f} s", file=sys.stderr, flush=True)
        Console(width=180).print(table)


if __name__ == "__main__":
    main()
