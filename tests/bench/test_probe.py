import json

import pytest
import torch

from leanlm.bench import probe
from leanlm.errors import LeanLMError

TINY = dict(nbytes=1 << 20, max_n=64)  # a probe of milliseconds; speeds are never asserted


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path))
    return tmp_path / "probe.json"


def test_peaks_cache_round_trip(cache, monkeypatch):
    threads_before = torch.get_num_threads()
    p = probe.peaks("cpu", threads=1, **TINY)
    assert torch.get_num_threads() == threads_before
    assert p.device == "cpu" and p.threads == 1
    assert p.bandwidth_gbs > 0
    assert set(p.matmul_gflops) == {"float32", "bfloat16", "float16"}
    assert all(v > 0 for v in p.matmul_gflops.values())

    table = json.loads(cache.read_text())
    key = probe.cache_key("cpu", 1, **TINY)
    assert list(table) == [key] and "threads=1" in key and f"torch={torch.__version__}" in key

    calls = []

    def fake_measure(device, threads, nbytes, max_n):
        calls.append(threads)
        return probe.Peaks("cpu", threads, 1.0, {"float32": 2.0})

    monkeypatch.setattr(probe, "measure_peaks", fake_measure)
    assert probe.peaks("cpu", threads=1, **TINY) == p  # served from the cache
    assert calls == []
    assert probe.peaks("cpu", threads=1, refresh=True, **TINY).bandwidth_gbs == 1.0
    assert probe.peaks("cpu", threads=2, **TINY).threads == 2  # another key: measured
    assert calls == [1, 2]
    assert len(json.loads(cache.read_text())) == 2
    assert probe.peaks("cpu", threads=1, **TINY).bandwidth_gbs == 1.0


def test_default_threads_and_damaged_cache(cache, monkeypatch):
    cache.write_text("{not json")
    monkeypatch.setattr(probe, "measure_peaks", lambda d, t, b, n: probe.Peaks("cpu", t, 3.0, {"float32": 4.0}))
    p = probe.peaks(**TINY)
    assert p.threads == torch.get_num_threads() and p.bandwidth_gbs == 3.0
    assert probe.cache_key("cpu", 1) != probe.cache_key("cpu", 1, **TINY)


def test_measure_functions_restore_threads():
    before = torch.get_num_threads()
    assert probe.measure_bandwidth("cpu", threads=1, nbytes=1 << 20) > 0
    assert probe.measure_matmul("cpu", torch.bfloat16, threads=1, max_n=32) > 0
    assert probe.measure_matmul("cpu", "float16", max_n=16) > 0
    assert torch.get_num_threads() == before
    assert "cpus" in probe.device_name("cpu")


def test_errors():
    with pytest.raises(LeanLMError, match="unknown device"):
        probe.peaks("tpu")
    with pytest.raises(LeanLMError, match="unknown device 'meta'"):
        probe.measure_bandwidth("meta")
    with pytest.raises(LeanLMError, match="threads must be at least 1"):
        probe.measure_bandwidth("cpu", threads=0, nbytes=1 << 20)
    with pytest.raises(LeanLMError, match="floating-point dtype"):
        probe.measure_matmul("cpu", torch.int8, max_n=16)
    if not torch.cuda.is_available():
        with pytest.raises(LeanLMError, match="no CUDA GPU is available"):
            probe.peaks("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peaks(cache):
    p = probe.peaks("cuda", nbytes=64 << 20, max_n=1024)
    assert p.device.startswith("cuda:") and p.bandwidth_gbs > 0
    assert "float32" in p.matmul_gflops and "float16" in p.matmul_gflops
    assert all(v > 0 for v in p.matmul_gflops.values())
    assert probe.peaks("cuda", nbytes=64 << 20, max_n=1024) == p
    assert torch.cuda.get_device_name() in next(iter(json.loads(cache.read_text())))
