"""The SQL index: the log index and the sample index.

* ``base``     — the seam: ``EventLog`` (log index), ``SampleIndex`` (samples,
                 checkpoints, watermark), ``Shard``, and their contract
                 (ordering, atomicity, which error each failure raises)
* ``sql``      — both on SQLAlchemy Core, shared by both backends, with the one
                 error boundary around every transaction
* ``sqlite``   — the embedded default's engines and payload location
* ``postgres`` — the production backend's engines and payload location
"""

__all__: list[str] = []
