"""`python -m leanlm.cli ...` runs the CLI (bench.compare starts fresh processes this way)."""

from leanlm.cli import main

main()
