"""trajstore: an event-sourced trajectory store and replay service for RL of LLM agents.

    import trajstore
    store = trajstore.connect()          # $TRAJSTORE_URL or the embedded SQLite default
    store.append(events)                 # wire-format dicts; atomic; idempotent
    stats = store.materialize()          # fold finished trajectories into samples
    for s in store.samples(): ...        # trajstore.Sample objects, numpy arrays
    for batch in trajstore.SampleReader(store, rank=0, world_size=8): ...   # trainer batches, resumable

    with trajstore.Writer(url) as writer: ...   # batched, retrying: to a store URL or an ingest service
"""

from trajstore._util import moved as _moved
from trajstore.errors import (
    ConflictError,
    CorruptStoreError,
    ResumeStateError,
    StoreUnavailable,
    TrajstoreError,
    ValidationError,
)
from trajstore.reader import ReaderConfig, SampleReader
from trajstore.sample import Sample
from trajstore.store import AppendResult, Store, connect
from trajstore.ingest.client import Writer
from trajstore import lineage  # noqa: F401 - trajstore.lineage.step_samples without importing it by name

_moved.install()

__all__ = [
    "AppendResult",
    "ConflictError",
    "CorruptStoreError",
    "ReaderConfig",
    "ResumeStateError",
    "Sample",
    "SampleReader",
    "Store",
    "StoreUnavailable",
    "TrajstoreError",
    "ValidationError",
    "Writer",
    "connect",
]
