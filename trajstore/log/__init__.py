"""The SQL index: the log index and the sample index.

* ``base``          — the seam: ``EventLog`` (log index), ``SampleIndex`` (samples,
                      checkpoints, watermark), ``Shard``, and their contract
                      (ordering, atomicity, which error each failure raises)
* ``_backend``      — ``Backend``: what a backend is (everything trajstore does
                      differently on one database)
* ``_registry``     — ``BACKENDS``, the one table from a store URL's database to its
                      backend (``backend_of``), and an engine's statements (``sql_dialect``)
* ``_sqlite``       — ``SQLite``, the embedded default: engines, the file check,
                      payload beside the file, positions from a counter row, the
                      read-only opener, the views' fragments
* ``postgres``      — ``PostgreSQL``, the production backend: engines, timeouts,
                      positions from a sequence and the tail's bound, the label
                      appends' lock, the migration lock, the read-only role opener,
                      the views' fragments
* ``_open``         — ``open_sql``: one database's log index and sample index
* ``_events``       — ``SqlEventLog``: the log index (the append, reads, segments)
* ``_samples``      — ``SqlSampleIndex`` and ``SqlProjectionIndex``: one implementation
                      of the default samples and a named projection's
* ``_segments``     — which segments index rows name, re-pointing, retiring
* ``_transaction``  — the engines and the one transaction wrapper (reads, writes,
                      a commit whose outcome is unknown)
* ``_dialect``      — ``SqlDialect``: the hot paths' cached driver statements every
                      backend shares
* ``_errors``       — the one driver-error translation boundary
* ``_retention``    — ``SqlRetention``: which trajectories every fold has passed, and the
                      guarded transaction that drops their archived events
* ``_pg_arrays``    — PostgreSQL: many rows as one statement of arrays (``unnest``): the
                      materializer commit's inserts and re-pointing
* ``_pg_partition`` — PostgreSQL: the event index partitioned by position (identities in
                      their own table, kept by a trigger)
"""

__all__: list[str] = []
