"""An append's content digests: computed once, on demand or on a pooled thread.

The duplicate rule (``_retries``) needs the digest of an event only when its
identity repeats; the index row of every stored event needs it at commit.
``Digests`` hashes each event at most once, and a large append's digests on
``DIGEST_POOL`` while the append goes on (the pool also runs the segments'
fsyncs: a thread per append cost ~1 ms).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Sequence

from trajstore._util.pools import LazyPool
from trajstore.events import ARRAY_FIELDS, Event, Generation, content_hash

__all__ = ["DIGEST_POOL", "Digests"]


class Digests:
    """Content digests of an append's events, computed once, on demand or in the background."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.events = events
        self.cache: dict[int, bytes] = {}

    def get(self, i: int) -> bytes:
        if i not in self.cache:
            self.cache[i] = content_hash(self.events[i])
        return self.cache[i]

    def start(self, indices: Sequence[int]) -> "Future[dict[int, bytes]]":
        """The digests of ``indices``: hashed on a pooled thread when there is
        enough to hash to pay for the hand-off, else here and now."""
        missing = [i for i in indices if i not in self.cache]
        if sum(_array_bytes(self.events[i]) for i in missing) < INLINE_DIGEST_BYTES:
            future: Future[dict[int, bytes]] = Future()
            future.set_result({i: self.get(i) for i in indices})
            return future
        return DIGEST_POOL.get().submit(lambda: {i: self.get(i) for i in indices})


# Below this many bytes of arrays per append, hashing here (XXH3: ~0.1 ms per
# MB) costs less than handing it to another thread and taking the GIL back.
INLINE_DIGEST_BYTES = 16 << 20


def _array_bytes(event: Event) -> int:
    if not isinstance(event, Generation):
        return 0
    arrays = (getattr(event, name) for name in ARRAY_FIELDS)
    return sum(a.nbytes for a in arrays if a is not None)


# One process-wide pool for the digests and the segment syncs (a thread per append cost ~1 ms).
DIGEST_POOL = LazyPool(max(1, min(4, os.cpu_count() or 1)), "trajstore-digest")
