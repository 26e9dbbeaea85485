"""The public entry points beyond the package's top level: load a model by name or path."""

from leanlm.models.loading import load

__all__ = ["load"]
