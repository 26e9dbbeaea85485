"""The sweep: build each variant once, measure its quality and its cost, keep every measured row on disk.

Everything measured is cached under `$LEANLM_CACHE/optimize/<model hash>/<environment hash>/` (`environment()`:
leanlm's code, torch, the CPU, the kernels), keyed by what it depends on: a built model by its steps and
calibration; a quality row by the model, KV cache and evaluation text; a cost row (the variant served and timed
under load, optimize.served) by all of the variant, the timing settings and the timing prompts' content. A resumed
(or repeated) sweep measures nothing twice; an upgraded one measures everything again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import torch

from leanlm import kernels
from leanlm.analysis.memory import weight_bytes_read
from leanlm.bench.compare import sizes
from leanlm.bench.cost import last_line
from leanlm.bench.probe import device_name
from leanlm.bench.workload import passage_prompts, read_prompts
from leanlm.cache.int8 import Int8KVCache
from leanlm.errors import LeanLMError
from leanlm.eval.datasets import load_text
from leanlm.eval.humaneval import evaluate, generate_completions, load_problems
from leanlm.eval.perplexity import perplexity, score
from leanlm.fetch import cache_dir
from leanlm.models.loading import load
from leanlm.models.zoo import resolve
from leanlm.optimize.served import measure_served, serve_args, served_utilization
from leanlm.optimize.variants import Variant, digest
from leanlm.runtime import child_env, cpu_count
from leanlm.tokenizer import Tokenizer


@dataclass(frozen=True)
class Settings:
    """How every variant is measured (part of each cached row's key)."""

    eval_tokens: int = 16384  # of the evaluation text, for perplexity, KL, top-1 and dp
    data: str | None = None  # evaluation text file (None: the built-in split)
    reference_dtype: str = "bfloat16"  # the original that KL, top-1 and the perplexity gap are measured against
    samples: int = 128  # calibration windows for methods that need data
    seq_len: int = 512
    prompt_tokens: int = 128  # timing (optimize.served): passage length of the built-in prompts
    new_tokens: int = 64  # tokens each timed request generates
    prompts: str | None = None  # the user's timing prompts (JSONL; None: passages of the evaluation text)
    levels: tuple[int, ...] = (1, 4, 16)  # concurrencies the served variant is loaded at (1 first: TTFT, TPOT)
    requests: int = 32  # timed requests per level (at least twice the level)
    compiled: bool = True  # served with --compile (decode steps as compiled graphs)
    threads: int | None = None
    humaneval: int = 0  # HumanEval problems for pass@1 (code models; 0: not measured)


@dataclass
class Measured:
    """One variant, measured: a row of results.json and of the report."""

    name: str
    variant: dict
    model_dir: str  # what `leanlm serve` loads for this variant
    perplexity: float
    ppl_gap: float  # perplexity / the original's - 1
    kl: float  # mean KL(original || variant) per token, nats
    top1: float  # top-1 agreement with the original
    dp: list[float]  # quantiles eval.perplexity.DP_QUANTILES of p(next token) - p_original(next token)
    dp_rms: float
    tokens: int  # evaluation tokens scored
    memory_mb: float  # resident weights
    disk_mb: float
    bits_per_weight: float
    weight_bytes: int  # read by each decode step
    ttft_ms: float  # served, concurrency 1: median time to the first token
    tpot_ms: float  # served, concurrency 1: median time per output token after the first
    tokens_per_s: float  # 1000 / tpot_ms
    mbu: float
    mfu: float
    peak_memory_mb: float | None  # peak RSS of the server process
    threads: int | None  # --threads given to the server (None: its own choice)
    throughput: float  # output tokens/s at the highest level timed
    curve: list[dict]  # bench.serve summaries, one per level (optimize.plan reads the RPS at an SLO from them)
    build_s: float = 0.0  # making the variant (quantize/prune), 0 for the model as it is
    quality_s: float = 0.0  # measuring its quality
    cost_s: float = 0.0  # serving it and timing every level (start-up and compilation included)
    pass1: float | None = None  # HumanEval pass@1 (code models)

    def to_dict(self) -> dict:
        return asdict(self)


def model_hash(path: Path) -> str:
    """sha256 over the files of a model directory (or a single file), names included."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path.parent if path.is_file() else path)).encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()[:16]


def environment() -> dict:
    """What a measurement depends on besides its variant and settings: leanlm's code (its version, the commit of a
    git checkout, and a hash of its sources, so an edited tree counts too), torch's version, the CPU (model, cores
    and ISA flags) and the kernels' sources. It names the cache's folder, so after an upgrade, a kernel fix or a
    move to another machine no build, perplexity or timing comes back as measured."""
    package = Path(__file__).parents[1]
    sources = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".cpp", ".h")):
        sources.update(str(path.relative_to(package)).encode() + path.read_bytes())
    git = subprocess.run(["git", "-C", str(package.parent), "rev-parse", "HEAD"], capture_output=True, text=True)
    return {"leanlm": version("leanlm"), "commit": git.stdout.strip() if git.returncode == 0 else None,
            "sources": sources.hexdigest()[:16], "torch": torch.__version__, "cpu": device_name("cpu"),
            "isa": hashlib.sha256(" ".join(kernels.cpu_flags()).encode()).hexdigest()[:16],
            "kernels": kernels.source_hash()}


class Sweep:
    """Measure `variants` of `model` with `settings`; `status(text)` hears what runs now."""

    def __init__(self, model: str, variants: tuple[Variant, ...], settings: Settings, root: Path | None = None,
                 status=lambda text: None):
        self.model, self.variants, self.settings, self.status = model, variants, settings, status
        self.source = resolve(model)
        self.base, env = root or cache_dir() / "optimize", environment()
        self.root = self.base / model_hash(self.source) / digest(env)
        _write_json(self.root / "environment.json", env)
        self._reference = None
        self._ids = None
        self._prompts = None

    def run(self, on_row=lambda row: None, ray_address: str | None = None) -> list[Measured]:
        """Every variant's row, in order; with `ray_address` ("local": a new local instance) the variants not
        measured yet run as Ray tasks, one per node's worth of CPUs, so that two never share cores while timed.
        The nodes must see this cache directory (one machine, or a shared file system)."""
        self.failed: dict[str, str] = {}  # variant -> why it could not be measured (the others go on)
        if ray_address is None:
            rows = []
            for variant in self.variants:
                try:
                    rows.append(self.measure(variant))
                except LeanLMError as e:
                    self.failed[variant.name] = str(e)
                    continue
                on_row(rows[-1])
            return rows
        return self._run_on_ray(on_row, ray_address)

    def _run_on_ray(self, on_row, address: str) -> list[Measured]:
        try:
            import ray  # optional (leanlm[ray]) and heavy: only --ray needs it
        except ImportError:
            raise LeanLMError("--ray needs Ray: pip install 'leanlm[ray]'") from None
        if not ray.is_initialized():
            if address == "local":  # on loopback only
                ray.init(address="local", include_dashboard=False, num_cpus=cpu_count(), _node_ip_address="127.0.0.1")
            else:
                ray.init(address=address)
        task = ray.remote(num_cpus=self.settings.threads or cpu_count())(_measure_on_worker)
        done = {}
        pending = {}
        for variant in self.variants:
            if self._row_path(variant).exists():
                done[variant.name] = self.measure(variant)
                on_row(done[variant.name])
            else:
                ref = task.remote(str(self.source), variant.to_dict(), asdict(self.settings), str(self.base))
                pending[ref] = variant.name
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            name = pending.pop(ready[0])
            try:
                done[name] = Measured(**ray.get(ready[0]))
            except ray.exceptions.RayTaskError as e:
                self.failed[name] = str(e.cause) if isinstance(e.cause, LeanLMError) else str(e)
                continue
            on_row(done[name])
        return [done[v.name] for v in self.variants if v.name in done]

    def _row_path(self, variant: Variant) -> Path:
        prompts = model_hash(Path(self.settings.prompts)) if self.settings.prompts else None  # the file's content
        return self.root / "rows" / f"{digest(['row', variant.to_dict(), asdict(self.settings), prompts])}.json"

    def measure(self, variant: Variant) -> Measured:
        path = self._row_path(variant)
        if path.exists():
            return Measured(**json.loads(path.read_text()))
        model_dir, build_s = self.build(variant)
        start = time.perf_counter()
        quality = self.quality(variant, model_dir)
        middle = time.perf_counter()
        self.status(f"{variant.name}: serving it, timing {len(self.settings.levels)} loads")
        cost = self.cost(variant, model_dir, quality["weight_bytes"])
        row = Measured(name=variant.name, variant=variant.to_dict(), model_dir=str(model_dir), build_s=build_s,
                       quality_s=middle - start, cost_s=time.perf_counter() - middle, **quality, **cost)
        _write_json(path, row.to_dict())
        return Measured(**json.loads(path.read_text()))  # as a resumed sweep will read it (tuples as lists)

    def build(self, variant: Variant) -> tuple[Path, float]:
        """The variant's model directory, made once by the recipe pipeline in a fresh process (leanlm.pipeline)."""
        if not variant.builds_model:
            return self.source, 0.0
        s = self.settings
        out = self.root / "models" / digest([variant.model_key(), s.samples, s.seq_len, s.data])
        record = out.parent / f"{out.name}.json"
        if out.exists() and record.exists():
            return out, json.loads(record.read_text())["seconds"]
        self.status(f"{variant.name}: building")
        if out.exists():  # a build interrupted between its rename and its record
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # the same file system: the rename below is atomic
            verb = "prune" if variant.prunes else "quantize"  # quantize adds an int8 lm_head to 4-bit weights
            args = {"model": str(self.source), "recipe": list(variant.steps), "out": str(Path(tmp) / "model"),
                    "samples": s.samples, "seq_len": s.seq_len, "dtype": variant.dtype, "data": s.data or None}
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "leanlm.pipeline", verb, json.dumps(args)],
                                  capture_output=True, text=True, env=child_env())
            seconds = time.perf_counter() - start
            if proc.returncode:
                raise LeanLMError(f"building variant {variant.name} failed: {last_line(proc.stderr) or 'no message'}")
            try:
                (Path(tmp) / "model").rename(out)
            except OSError:  # another worker (Ray) built the same model meanwhile: theirs is as good
                if not out.exists():
                    raise
        _write_json(record, {"seconds": seconds, "steps": list(variant.steps)})
        return out, seconds

    def quality(self, variant: Variant, model_dir: Path) -> dict:
        """Perplexity, KL, top-1 and dp against the original (in reference_dtype) on the evaluation text, and the
        variant's size in memory."""
        s = self.settings
        key = digest([str(model_dir), variant.dtype, variant.kv_cache, s.eval_tokens, s.data, s.reference_dtype,
                      s.humaneval])
        path = self.root / "quality" / f"{key}.json"
        if path.exists():
            return json.loads(path.read_text())
        self.status(f"{variant.name}: quality")
        reference, ids = self._reference_and_ids()
        net, tok = load(model_dir, variant.dtype, "cpu", progress=False)
        ppl, agree = score(net, ids, reference, cache_cls=Int8KVCache if variant.kv_cache == "int8" else None)
        base_ppl = self._base_perplexity()
        size = sizes(net, model_dir)
        result = dict(perplexity=ppl.perplexity, ppl_gap=ppl.perplexity / base_ppl - 1 if base_ppl else 0.0,
                      kl=max(agree.kl, 0.0), top1=agree.top1, dp=list(agree.dp), dp_rms=agree.dp_rms,
                      tokens=ppl.tokens, memory_mb=size["memory_mb"], disk_mb=size["disk_mb"],
                      bits_per_weight=size["bits_per_weight"], weight_bytes=weight_bytes_read(net))
        if s.humaneval:
            result["pass1"] = self._pass1(variant, net, tok)
        _write_json(path, result)
        return result

    def _pass1(self, variant: Variant, net, tok) -> float:
        """HumanEval pass@1 of greedy completions (the engine, the variant's KV cache), each run sandboxed."""
        self.status(f"{variant.name}: HumanEval")
        problems = load_problems(self.settings.humaneval)
        completions = generate_completions(net, tok, problems, kv_cache=variant.kv_cache)
        return evaluate(completions, problems).pass_at[1]

    def _reference_and_ids(self):
        if self._reference is None:
            self._reference, tok = load(self.source, self.settings.reference_dtype, "cpu", progress=False)
            self._ids = torch.tensor(tok.encode(load_text(Path(self.settings.data) if self.settings.data else None))
                                     [: self.settings.eval_tokens])
        return self._reference, self._ids

    def _base_perplexity(self) -> float:
        """The original's perplexity on the same tokens (measured once, cached like a quality row)."""
        s = self.settings
        path = self.root / "quality" / f"{digest(['base', s.eval_tokens, s.data, s.reference_dtype])}.json"
        if path.exists():
            return json.loads(path.read_text())["perplexity"]
        reference, ids = self._reference_and_ids()
        value = perplexity(reference, ids).perplexity
        _write_json(path, {"perplexity": value})
        return value

    def cost(self, variant: Variant, model_dir: Path, weight_bytes: int) -> dict:
        """The variant served as the report prints it, timed at each level on the timing prompts (optimize.served)."""
        s = self.settings
        r = measure_served(model_dir, serve_args(variant.to_dict(), s.compiled, s.threads), self.prompts(), s.levels,
                           s.requests, s.new_tokens)
        mbu, mfu = served_utilization(model_dir, variant.dtype, variant.kv_cache, weight_bytes, r.pop("prompt_tokens"),
                                      s.new_tokens, r["ttft_ms"], r["tpot_ms"], s.threads or cpu_count())
        return {**r, "mbu": mbu, "mfu": mfu, "threads": s.threads}

    def prompts(self) -> list:
        """The timing prompts: the user's file, or passages of the evaluation text (bench.workload)."""
        if self._prompts is None:
            s = self.settings
            self._prompts = (read_prompts(s.prompts) if s.prompts else
                             passage_prompts(Tokenizer(self.source), 64, s.prompt_tokens, "evaluation"))
        return self._prompts


def _measure_on_worker(source: str, variant: dict, settings: dict, root: str) -> dict:
    """A Ray task: one variant measured on the node it lands on, into the shared cache."""
    v = Variant(**{**variant, "steps": tuple(variant["steps"])})
    return Sweep(source, (v,), Settings(**settings), Path(root)).measure(v).to_dict()


def _write_json(path: Path, obj) -> None:
    """Write atomically, so an interrupted sweep never leaves a half row that a resumed one would trust; each writer
    has its own temporary file, as Ray workers write the same environment.json at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(obj, indent=1))
    os.replace(tmp, path)

