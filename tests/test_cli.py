"""The CLI as a user runs it: one clear line on bad input, JSON where promised."""

import json
import subprocess

import pytest

from leanlm.bench.serve import leanlm_command


def leanlm(*args, env=None):
    return subprocess.run(leanlm_command(*map(str, args)), capture_output=True, text=True, env=env)


def test_generate_eval_bench_info_on_a_directory(tiny_dir, tmp_path_factory):
    r = leanlm("generate", tiny_dir, "hello world", "--max-tokens", "5", "--threads", "1", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    text = tmp_path_factory.mktemp("data") / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    r = leanlm("eval", tiny_dir, "--data", text, "--json", "--threads", "1", "--window", "64", "--stride", "32")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["perplexity"] > 1 and report["tokens"] > 100
    r = leanlm("bench", tiny_dir, "--json", "--threads", "1", "--prompt-tokens", "16", "--new-tokens", "8", "--eager")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    for key in ("ttft_ms", "tpot_ms", "tokens_per_s", "mbu", "threads", "dtype"):
        assert key in report
    assert report["threads"] == 1 and report["tokens_per_s"] > 0
    r = leanlm("info", tiny_dir, "--dtype", "float32")
    assert r.returncode == 0 and "KV cache" in r.stdout


def test_eval_defaults_fit_a_short_context(tiny_dir, tmp_path_factory):
    """The default window (1024) and stride (512) are cut to a 256-token context; a stride the user gave is cut
    with a note on stderr."""
    text = tmp_path_factory.mktemp("data") / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 80)
    args = ("eval", tiny_dir, "--data", text, "--json", "--threads", "1", "--dtype", "float32")
    r = leanlm(*args)
    assert r.returncode == 0, r.stderr
    assert (json.loads(r.stdout)["window"], json.loads(r.stdout)["stride"]) == (256, 256) and "stride" not in r.stderr
    r = leanlm(*args, "--stride", "300")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stride"] == 256 and "--stride 300 is more than the 256-token window" in r.stderr


def test_generate_file_runs_prompts_through_the_engine(tiny_dir, tmp_path_factory):
    prompts = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    lines = [{"prompt": "hello world", "max_tokens": 4, "ignore_eos": True},
             {"messages": [{"role": "user", "content": "the quick"}], "n": 2, "temperature": 1.0, "seed": 1},
             {"prompt": "def f(x):"}]
    prompts.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    r = leanlm("generate", tiny_dir, "--file", prompts, "--max-tokens", "6", "--threads", "1", "--dtype", "float32",
               "--kv-cache-memory", "16MiB", "--deterministic", "--prompt-lookup", "2")
    assert r.returncode == 0, r.stderr
    results = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["index"] for x in results] == [0, 1, 2]
    assert results[0]["completions"][0]["tokens"] == 4 and len(results[1]["completions"]) == 2
    assert all(1 <= c["tokens"] <= 6 for x in results[1:] for c in x["completions"])
    r = leanlm("generate", tiny_dir, "--file", prompts, "--max-tokens", "6", "--threads", "1", "--kv-cache", "int4")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 3, r.stderr
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "x", "top_q": 1}\n')
    r = leanlm("generate", tiny_dir, "--file", prompts)
    assert r.returncode == 2 and "line 2: unknown field(s) top_q" in r.stderr and "Traceback" not in r.stderr


def test_stdout_is_the_completion_even_when_a_gguf_is_converted_first(tmp_path):
    import os

    from tests.models.test_gguf import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    env = {**os.environ, "LEANLM_CACHE": str(tmp_path / "cache")}
    args = ("generate", tmp_path / "tiny.gguf", "hello", "--max-tokens", "4", "--threads", "1", "--dtype", "float32")
    first, again = leanlm(*args, env=env), leanlm(*args, env=env)  # converts, then finds the conversion cached
    assert first.returncode == 0 and again.returncode == 0, first.stderr
    assert "converting tiny.gguf" in first.stderr and "converting" not in again.stderr
    assert first.stdout == again.stdout


@pytest.mark.parametrize("args,message", [
    (["generate", "no-such-model", "hi"], "smollm2-135m"),
    (["generate", "/no/such/dir", "hi"], "does not exist"),
    (["eval", "{dir}", "--data", "/no/such/file.txt"], "/no/such/file.txt"),
    (["generate", "{dir}", "hi", "--top-p", "2"], "top_p"),
    (["generate", "{dir}", "hi", "--dtype", "int3"], "unknown dtype"),
    (["generate", "{dir}", "hello " * 300], "context window"),
    (["bench", "{dir}", "--threads", "0"], "threads"),
    (["compress-prompt", "--scorer", "{dir}"], "TEXT or with --file"),
    (["compress-prompt", "-f", "/no/such.txt", "--scorer", "{dir}"], "/no/such.txt"),
    (["compress-prompt", "hello " * 40, "--scorer", "{dir}", "--method", "zip"], "unknown compression method"),
    (["generate", "{dir}", "hi", "--kv-cache", "16"], "use auto"),
    (["serve", "{dir}", "--kv-cache", "fp8"], "auto (the model's dtype), int8 or int4"),
    (["serve", "{dir}", "--prepare-compression", "zip"], "--prepare-compression must be one of"),
    (["serve", "{dir}", "--replicas", "2", "--engine-process"], "--engine-process is for one server"),
    (["generate", "{dir}", "hi", "--kv-cache", "int4"], "int4 KV cache lives in the serving engine's paged pool"),
    (["generate", "{dir}", "hi", "--regex", "a+", "--max-num-seqs", "0"], "max_num_seqs must be"),
])
def test_bad_input_is_one_clear_line(tiny_dir, args, message):
    r = leanlm(*[a.replace("{dir}", str(tiny_dir)) for a in args])
    assert r.returncode != 0
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_unsupported_architecture(tiny_dir):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tiny_dir / "config.json").write_text(json.dumps(cfg))
    r = leanlm("generate", tiny_dir, "hi")
    assert r.returncode == 2 and "supported: llama, mistral, qwen2" in r.stderr


def test_every_verb_has_help():
    for verb in ("pull", "generate", "eval", "bench", "info", "serve", "prune", "compress-prompt"):
        r = leanlm(verb, "--help")
        assert r.returncode == 0 and "Usage" in r.stdout


def test_compress_prompt_prints_the_prompt_and_its_ratio(tiny_dir, tmp_path):
    text = "the quick brown fox jumps over the lazy dog 42 times. hello world, hello there.\n\n" * 4
    (tmp_path / "p.txt").write_text(text)
    r = leanlm("compress-prompt", "-f", tmp_path / "p.txt", "--scorer", tiny_dir, "--rate", "0.4", "--question",
               "how many?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n").endswith("how many?") and r.stdout.count("42") == 4
    assert "tokens (" in r.stderr and "x, llmlingua)" in r.stderr
    r = leanlm("compress-prompt", text, "--scorer", tiny_dir, "--target-tokens", "30", "--method", "selective", "--json")
    report = json.loads(r.stdout)
    assert report["method"] == "selective" and report["compressed_tokens"] <= 33 and report["ratio"] > 2


def test_speculative_generate_and_bench(tiny_dir):
    plain = leanlm("generate", tiny_dir, "hello world", "--max-tokens", "8", "--threads", "1", "--dtype", "float32")
    lookup = leanlm("generate", tiny_dir, "hello world", "--max-tokens", "8", "--threads", "1", "--dtype", "float32",
                    "--prompt-lookup", "--stats")
    assert lookup.returncode == 0, lookup.stderr
    assert lookup.stdout == plain.stdout and "acceptance" in lookup.stderr
    drafted = leanlm("generate", tiny_dir, "hello world", "--max-tokens", "8", "--threads", "1", "--dtype", "float32",
                     "--draft", tiny_dir, "--num-speculative", "3")
    assert drafted.returncode == 0 and drafted.stdout == plain.stdout
    from tests.conftest import make_hf_model

    make_hf_model("llama", tiny_dir, max_position_embeddings=2048)  # room for the built-in grounded prompts
    r = leanlm("bench", tiny_dir, "--prompt-lookup", "2", "--new-tokens", "8", "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    for key in ("acceptance", "acceptance_per_position", "tokens_per_target_forward", "draft_time_share",
                "predicted_speedup", "measured_speedup"):
        assert key in report


def test_bench_speculative_on_given_prompts(tiny_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello world"}\n{"messages": [{"role": "user", "content": "the quick fox"}]}\n')
    r = leanlm("bench", tiny_dir, "--draft", tiny_dir, "--prompts", prompts, "--new-tokens", "6", "--threads", "1",
               "--dtype", "float32", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["prompts"] == 2 and report["acceptance"] == 1.0  # the target drafting for itself
    r = leanlm("bench", tiny_dir, "--prompts", prompts, "--threads", "1")
    assert r.returncode == 2 and "--draft" in r.stderr and "Traceback" not in r.stderr
    prompts.write_text("not json\n")
    r = leanlm("bench", tiny_dir, "--draft", tiny_dir, "--prompts", prompts, "--threads", "1")
    assert r.returncode == 2 and "line 1" in r.stderr and "Traceback" not in r.stderr


def test_draft_with_another_tokenizer_is_refused(tiny_dir, tmp_path_factory):
    from tests.conftest import make_hf_model, make_tokenizer

    from tokenizers import Tokenizer

    other = tmp_path_factory.mktemp("other")
    make_hf_model("llama", other)
    make_tokenizer(other)
    tok = Tokenizer.from_file(str(other / "tokenizer.json"))
    tok.add_tokens(["<extra>"])
    tok.save(str(other / "tokenizer.json"))
    r = leanlm("generate", tiny_dir, "hello", "--draft", other, "--threads", "1")
    assert r.returncode == 2 and "tokenizer" in r.stderr and "Traceback" not in r.stderr


def test_demo_status_lines_go_to_stderr(tiny_dir, monkeypatch, capsys):
    from types import SimpleNamespace

    from leanlm.bench import latency
    from leanlm.cli import app

    result = SimpleNamespace(dtype="float32", device="cpu", threads=1, ttft_ms=1.0, tpot_ms=1.0, tokens_per_s=1.0,
                             mbu=0.1, peak_bandwidth_gbs=1.0, mfu=0.1, peak_gflops=1.0, peak_memory_mb=1.0)
    monkeypatch.setattr(latency, "bench", lambda *args, **kwargs: result)  # no compilation in a unit test
    app(["demo", str(tiny_dir), "--compile", "--threads", "1", "--dtype", "float32"], standalone_mode=False)
    captured = capsys.readouterr()
    assert "compiling the decode step" in captured.err and "compiling" not in captured.out
    assert "leanlm summary" in captured.out


def test_serve_reads_its_api_key_from_the_environment_and_says_so():
    r = leanlm("serve", "--help", env={**__import__("os").environ, "COLUMNS": "200"})
    assert r.returncode == 0 and "LEANLM_API_KEY" in r.stdout and "--api-key-file" in r.stdout
