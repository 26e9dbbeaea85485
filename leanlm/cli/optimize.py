"""`leanlm optimize`: sweep compressed variants, measure quality against cost, draw the Pareto frontier, recommend."""

from __future__ import annotations

from leanlm.cli.common import app  # noqa: F401  (verbs register on it)
