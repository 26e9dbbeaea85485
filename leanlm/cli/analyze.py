"""`leanlm analyze`: per-op FLOPs, bytes and arithmetic intensity against this machine's roofline."""

from __future__ import annotations

from leanlm.cli.common import app  # noqa: F401  (verbs register on it)
