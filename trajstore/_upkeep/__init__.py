"""Upkeep: payload GC, aggregate compaction, retention."""
