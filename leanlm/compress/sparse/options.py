"""The options every unstructured pruning method takes (magnitude, Wanda, SparseGPT, Taylor): how much to prune,
as a fraction or an N:M pattern, checked once against the model before any work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from leanlm.compress.registry import decoder_linears
from leanlm.compress.sparse.masks import check_pattern_fits, parse_pattern, pattern_sparsity


@dataclass(frozen=True)
class SparsityOptions:
    """Options every unstructured method takes: the fraction pruned (default 0.5) or an N:M pattern ('2:4')
    that fixes it to (M - N) / M."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "prune"
    sparsity: float | None = None
    pattern: str | None = None

    def __post_init__(self):
        pattern_sparsity(self.pattern, self.sparsity)  # raises on a bad value or a disagreeing pair

    @property
    def target(self) -> float:
        return pattern_sparsity(self.pattern, self.sparsity)

    @property
    def nm(self) -> tuple[int, int] | None:
        return parse_pattern(self.pattern)

    def check_fits(self, model) -> None:
        """Fail before any work when the pattern's M does not divide some projection's in_features."""
        for name, linear in decoder_linears(model):
            check_pattern_fits(self.nm, linear.in_features, name)
