"""Architecture adapters and the built-in table."""

from .adapter import ArchitectureAdapter

__all__ = ["ArchitectureAdapter"]
