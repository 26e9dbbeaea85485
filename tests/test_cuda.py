"""The CUDA paths end to end on tiny models: each result equals the CPU's (or transformers') on the same weights.

Skipped without a GPU (CI has none); run on a GPU machine with `python -m pytest -m cuda`.
"""

from __future__ import annotations

import json

import pytest
import torch

from leanlm.distillation.trainer import DistillConfig, Trainer
from leanlm.prompt.compressor import PromptCompressor
from leanlm.engine import Engine, EngineConfig
from leanlm.generation.compiled import CompiledDecoder
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.speculative import DraftProposer, speculative_generate
from leanlm.generation.text import generate
from leanlm.models.loading import load_model
from leanlm.tokenizer import Tokenizer
from tests.conftest import make_hf_model
from tests.generation.test_speculative import plain_greedy
from tests.test_cli import leanlm

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")
NEW = 16  # tokens generated per prompt
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
PROMPTS = [[5, 9, 11, 3], list(range(20, 61)), [7] * 9]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 0.1), (torch.float16, 2e-2)])
def test_logits_match_transformers_on_cuda(tiny_hf, dtype, tol):
    _, path, ref = tiny_hf
    model = load_model(path, dtype, CUDA)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1)).to(CUDA)
    ours = model(tokens, torch.arange(17, device=CUDA)[None].expand(2, -1)).float()
    with torch.no_grad():
        theirs = ref.to(CUDA, dtype)(tokens).logits.float()
    assert ours.device.type == "cuda"
    assert (ours - theirs).abs().max() < tol * theirs.abs().max()


def test_greedy_decoding_on_cuda_equals_the_cpu(tiny_dir):
    cpu, gpu = load_model(tiny_dir, torch.float32), load_model(tiny_dir, torch.float32, CUDA)
    for prompt in PROMPTS:
        assert plain_greedy(gpu, prompt, NEW) == plain_greedy(cpu, prompt, NEW)


def test_compiled_decoding_on_cuda_equals_eager(tiny_dir):
    model, tok = load_model(tiny_dir, torch.float32, CUDA), Tokenizer(tiny_dir)
    texts = ["hello world", "the quick brown fox"]
    eager = generate(model, tok, texts, GREEDY)
    decoder = CompiledDecoder(model)
    compiled = generate(model, tok, texts, GREEDY, compiled=decoder)
    assert [c.tokens for c in compiled] == [c.tokens for c in eager]
    # a new cache of the same shape: the step's CUDA graph is captured again for the new cache's tensors
    others = ["hello there", "def f(x): return"]
    assert [c.tokens for c in generate(model, tok, others, GREEDY, compiled=decoder)] == \
        [c.tokens for c in generate(model, tok, others, GREEDY)]


@pytest.mark.parametrize("options", [dict(kv_cache_memory=1 << 24), dict(block_size=4, kv_cache_memory=1 << 16)])
def test_the_engine_on_cuda_equals_one_request_at_a_time(tiny_dir, options):
    """Continuous batching over the paged KV cache (with preemption when the pool is small) on the GPU."""
    model, tok = load_model(tiny_dir, torch.float32, CUDA), Tokenizer(tiny_dir)
    engine = Engine(model, tok, EngineConfig(**options))
    ps = PROMPTS * 4
    seqs = [engine.add_request(str(i), p, GREEDY)[0] for i, p in enumerate(ps)]
    while engine.has_work:
        engine.step()
    assert [s.output_ids for s in seqs] == [plain_greedy(model, p, NEW) for p in ps]
    assert engine.pool.k[0].device.type == "cuda"


def test_speculative_decoding_on_cuda_equals_target_greedy(tmp_path):
    make_hf_model("llama", tmp_path / "t", seed=0)
    make_hf_model("llama", tmp_path / "d", seed=1, num_hidden_layers=1)
    target, draft = load_model(tmp_path / "t", torch.float32, CUDA), load_model(tmp_path / "d", torch.float32, CUDA)
    for prompt in PROMPTS:
        out = [t for step in speculative_generate(target, prompt, GREEDY, DraftProposer(draft, 80, GREEDY), 4)
               for t in step]
        assert out == plain_greedy(target, prompt, NEW)


@pytest.mark.parametrize("name,kw", [("w8a16", dict(bits=8)), ("w4a16", dict(bits=4, group_size=32)),
                                     ("w8a8", dict(bits=8, act_bits=8))])
def test_a_quantized_directory_runs_on_cuda_like_on_the_cpu(tiny_dir, tmp_path, name, kw):
    out = tmp_path / name
    args = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    r = leanlm("quantize", tiny_dir, "--method", "rtn", *args, "-o", out, "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    cpu, gpu = load_model(out, torch.float32), load_model(out, torch.float32, CUDA)
    tokens = torch.arange(3, 40)[None]
    a = cpu(tokens, torch.arange(37)[None]).float()
    b = gpu(tokens.to(CUDA), torch.arange(37, device=CUDA)[None]).float().cpu()
    assert (a - b).abs().max() < 2e-2 * a.abs().max()


def test_cli_verbs_run_on_cuda(tiny_dir, tmp_path):
    common = ("--device", "cuda", "--dtype", "float32")
    r = leanlm("generate", tiny_dir, "hello world", "--max-tokens", "6", *common)
    assert r.returncode == 0, r.stderr
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 40)
    cpu = leanlm("eval", tiny_dir, "--data", text, "--json", "--window", "64", "--stride", "32", "--dtype", "float32")
    gpu = leanlm("eval", tiny_dir, "--data", text, "--json", "--window", "64", "--stride", "32", *common)
    assert gpu.returncode == 0, gpu.stderr
    assert json.loads(gpu.stdout)["perplexity"] == pytest.approx(json.loads(cpu.stdout)["perplexity"], rel=1e-3)
    r = leanlm("bench", tiny_dir, "--json", "--prompt-tokens", "16", "--new-tokens", "8", *common)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["tokens_per_s"] > 0 and report["device"].startswith("cuda")


def test_distillation_on_cuda_brings_a_student_closer_to_its_teacher(tmp_path):
    make_hf_model("llama", tmp_path / "t", seed=0)
    make_hf_model("llama", tmp_path / "s", seed=1, num_hidden_layers=1)
    teacher = load_model(tmp_path / "t", torch.float32, CUDA)
    student = load_model(tmp_path / "s", torch.float32, CUDA)
    ids = torch.randint(3, 128, (4096,), generator=torch.Generator().manual_seed(0))
    config = DistillConfig(loss="fkl", lr=1e-2, batch_size=4, seq_len=32, steps=30, eval_every=30, eval_tokens=256)
    history = Trainer(teacher, student, ids[:3072], ids[3072:], config).run()
    assert next(student.parameters()).device.type == "cuda"
    assert history.evals[-1]["kl"] < 0.8 * history.evals[0]["kl"]


def test_prompt_compression_on_cuda_keeps_what_the_cpu_keeps(tiny_dir):
    context = ["the quick brown fox jumps over the lazy dog, 42 times. " * 6, "hello world, hello there. " * 8]
    kept = [PromptCompressor(model=(load_model(tiny_dir, torch.float32, dev), Tokenizer(tiny_dir)))
            .compress(context, question="what did the fox do?", rate=0.5).text for dev in ("cpu", CUDA)]
    assert kept[0] == kept[1]
