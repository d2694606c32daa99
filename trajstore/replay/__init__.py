"""The replay service: trainers on other machines read samples through Arrow Flight.

* ``_server.py`` ``trajstore replay``: a ``pyarrow.flight`` server holding the
  store's credentials; bearer tokens (read / write roles), rate limiting,
  Prometheus metrics.
* ``client.py``  ``ReplayReader`` (a ``SampleReader`` over replay servers:
  same config, batches and resume state) and ``ReplayStore``.
* ``dataset.py`` ``ReplayDataset``: ``SampleDataset`` over replay servers
  (torch; for ``DataLoader`` / ``StatefulDataLoader``).
* ``_protocol.py`` tickets, their checks, the wire schema of index rows.

See docs/replay.md.
"""

from trajstore.replay.client import ReplayReader, ReplayStore

__all__ = ["ReplayReader", "ReplayStore"]
