"""Storing int8 layers pruned 2:4 compactly (lowbit.sparse24: kept codes + position masks, 5 bits a weight)."""

from __future__ import annotations

from leanlm.lowbit.linear import W8A16Linear, W8A16Sparse24Linear
from leanlm.lowbit.record import replace
from leanlm.lowbit.sparse24 import is_24


def compact_24(model, records: dict[str, dict]) -> list[str]:
    """Swap every W8A16Linear whose codes are 2:4 sparse for a W8A16Sparse24Linear holding the same codes, and
    note the new scheme in its record (quantization.json); return the names of the layers swapped."""
    swapped = [name for name, m in model.named_modules() if type(m) is W8A16Linear and is_24(m.weight)]
    for name in swapped:
        new = W8A16Sparse24Linear.from_w8(model.get_submodule(name), name)
        replace(model, name, new)
        records[name] = {**records.get(name, {}), **new.record()}
    return swapped
