"""The SQL index: the log index and the sample index.

* ``base``          — the seam: ``EventLog`` (log index), ``SampleIndex`` (samples,
                      checkpoints, watermark), ``Shard``, and their contract
                      (ordering, atomicity, which error each failure raises)
* ``postgres``      — the production backend's engines, timeouts and payload location
* ``_sqlite``       — the embedded default's engines and payload location
* ``_open``         — ``open_sql``: one database's log index and sample index
* ``_events``       — ``SqlEventLog``: the log index (the append, reads, segments)
* ``_samples``      — ``SqlSampleIndex`` and ``SqlProjectionIndex``: one implementation
                      of the default samples and a named projection's
* ``_segments``     — which segments index rows name, re-pointing, retiring
* ``_transaction``  — the engines and the one transaction wrapper (reads, writes,
                      a commit whose outcome is unknown)
* ``_dialect``      — ``SQLite`` / ``PostgreSQL``: every dialect-specific statement
                      and behaviour, and the hot paths' cached driver statements
* ``_errors``       — the one driver-error translation boundary
"""

__all__: list[str] = []
