"""A function run in a helper process on copies of its arguments whose tensors are empty: compiling a graph needs
every tensor's shape, strides, dtype and device, not its values. A server compiles its decode graphs so on both
cores (engine.compiled): the helper builds half of them into inductor's on-disk caches while the server builds the
rest. No weights cross, and the helper's empty pages are never committed.

The stream is pickled: it goes from this process to its own child over a pipe, never through a file."""

from __future__ import annotations

import pickle
import subprocess
import sys
import tempfile

import torch

from leanlm.runtime import child_env, follow_parent


class _Pickler(pickle.Pickler):
    """Sends each tensor as (index, Parameter or not, requires_grad, shape, strides, dtype, device); one tensor
    reached twice (a tied weight) is one index, so the copy keeps the sharing."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.index: dict[int, tuple[int, torch.Tensor]] = {}  # id -> (index, the tensor, held so ids stay unique)

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            return None
        index = self.index.setdefault(id(obj), (len(self.index), obj))[0]
        return (index, isinstance(obj, torch.nn.Parameter), obj.requires_grad, tuple(obj.shape), obj.stride(),
                str(obj.dtype).removeprefix("torch."), str(obj.device))


class _Unpickler(pickle.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self.made: dict[int, torch.Tensor] = {}

    def persistent_load(self, pid):
        index, parameter, requires_grad, shape, stride, dtype, device = pid
        if index not in self.made:
            empty = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
            self.made[index] = torch.nn.Parameter(empty, requires_grad) if parameter else empty
        return self.made[index]


class Helper:
    """fn(*args) in a new process, every tensor in args empty there (fn: a module-level function). It runs on as
    many threads as this process: inductor writes its C++ loops for the thread count, so a graph compiled on
    another count is another graph, in another cache entry."""

    def __init__(self, fn, *args):
        self._log = tempfile.TemporaryFile()  # a file, not a pipe: a chatty helper never blocks on a full pipe
        self._process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=self._log,
                                         env=child_env())
        try:
            _Pickler(self._process.stdin).dump((fn, args, torch.get_num_threads()))
            self._process.stdin.close()
        except BaseException:
            self._process.kill()
            raise

    def wait(self, timeout: float) -> str:
        """Wait for the helper (killed after `timeout` seconds): '' when it succeeded, else why not."""
        try:
            code = self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
            return f"it ran past {timeout:.0f} s"
        self._log.seek(0)
        lines = self._log.read().decode(errors="replace").strip().splitlines()
        self._log.close()
        return "" if code == 0 else (lines[-1] if lines else f"exit status {code}")


def _main() -> None:
    follow_parent()  # a server stopped while it builds stops its helper too
    fn, args, threads = _Unpickler(sys.stdin.buffer).load()
    torch.set_num_threads(threads)
    fn(*args)


if __name__ == "__main__":
    _main()
