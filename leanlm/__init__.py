"""leanlm: make transformer language models cheap to run."""
