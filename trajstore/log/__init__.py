"""The event log's index in SQL.

* ``base``     — the backend interface and its contract (ordering, atomicity, errors)
* ``sql``      — that interface on SQLAlchemy Core, shared by both backends
* ``sqlite``   — the embedded default's engines and payload location
* ``postgres`` — the production backend's engines and payload location
"""

__all__: list[str] = []
