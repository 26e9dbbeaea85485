"""`leanlm plan`: how many replicas a served variant needs for a request rate under a latency SLO."""

from __future__ import annotations

from leanlm.cli.common import app  # noqa: F401  (verbs register on it)
