"""Store backends: where expert bytes come from. See ``base.ExpertStore`` for the interface."""

from .base import ExpertStore, StoreStats

__all__ = ["ExpertStore", "StoreStats"]
