"""Keeping a long-lived process's start-up heap out of the cyclic garbage collector's scans."""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Move every object alive now into the collector's permanent generation (gc.freeze), so that
    later collections, the full ones included, walk only what is allocated afterwards. For processes
    whose start-up state (modules, the model's wrappers, tokenizer tables) lives as long as they do.

    Objects frozen by an earlier call are released first and collected with the rest, so that calling
    it again after replacing an engine frees the old one's reference cycles instead of keeping them
    frozen for good. Returns how many objects are frozen now."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
