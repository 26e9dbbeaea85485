import mmap
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from leanlm import runtime
from leanlm.models.layers import Linear
from leanlm.models.loading import load_model
from leanlm.runtime import HUGE_PAGE, weights_on_huge_pages

needs_thp = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) here")


def _tensors(model):
    return list(model.parameters()) + list(model.buffers())


@needs_thp
def test_loaded_weights_share_one_huge_page_aligned_buffer(tiny_dir):
    model = load_model(tiny_dir, torch.bfloat16)
    tensors = _tensors(model)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert min(t.data_ptr() for t in tensors) % HUGE_PAGE == 0
    assert all(t.data_ptr() % 64 == 0 for t in tensors)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied weights stay one tensor
    assert all(isinstance(p, torch.nn.Parameter) and not p.requires_grad for p in model.parameters())


@needs_thp
def test_moving_weights_keeps_every_value_and_the_outputs(tiny_dir):
    model = load_model(tiny_dir, torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.tensor([[1, 5, 9, 3]])
    positions = torch.arange(4)[None]
    with torch.inference_mode():
        logits = model(tokens, positions, None)
    assert weights_on_huge_pages(model)  # again: a second move is a plain copy
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with torch.inference_mode():
        assert torch.equal(model(tokens, positions, None), logits)


@pytest.mark.parametrize("bf16_gemm", [True, False])
def test_prefill_products_run_in_the_cpus_fast_dtype(monkeypatch, bf16_gemm):
    monkeypatch.setattr(runtime, "CPU_BF16_GEMM", bf16_gemm)
    cpu = torch.device("cpu")
    assert runtime.matmul_dtype(torch.float16, cpu) == torch.float32
    assert runtime.matmul_dtype(torch.bfloat16, cpu) == (torch.bfloat16 if bf16_gemm else torch.float32)
    assert runtime.matmul_dtype(torch.float32, cpu) == torch.float32
    lin = Linear(64, 32).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    cdt = torch.bfloat16 if bf16_gemm else torch.float32
    expect = F.linear(x.to(cdt), lin.weight.to(cdt), lin.bias.to(cdt)).bfloat16()
    assert torch.equal(lin(x), expect)
    assert torch.equal(lin(x[:1]), F.linear(x[:1], lin.weight, lin.bias))  # one row (decode): the weight's dtype


def test_a_child_reports_its_own_peak_memory_not_its_parents():
    import subprocess
    import sys

    ballast = b"\1" * 2**30  # this process's peak now exceeds 1 GiB; exec'd children inherit it in ru_maxrss
    code = ("import resource; from leanlm.runtime import peak_rss_mb; "
            "print(peak_rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    own, inherited = map(float, subprocess.check_output([sys.executable, "-c", code], text=True).split())
    assert inherited > 1024 and own < 700 and len(ballast) == 2**30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_server_started_by_a_leanlm_process_ends_when_that_process_is_killed(tiny_dir, tmp_path):
    """`optimize` serves each variant from a child process: killed with SIGKILL, it must not leave that server
    running (follow_parent)."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from leanlm.bench.serve import LocalServer\n"
        f"with LocalServer.leanlm({str(tiny_dir)!r}, 'tiny', ['--kv-cache-memory', '16MiB']) as server:\n"
        "    print(server.proc.pid, flush=True)\n"
        "    time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.time() + 60
    while _alive(child) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
