"""Looking at a store: SQL views, the read-only SQL console, the HTML report
and the Parquet export.

* ``views``  — the inspection views' SQL (created by migration 0002) and the reader role
* ``sql``    — ``trajstore sql``: read-only queries over those views
* ``report`` — ``trajstore report``: HTML + plots from the views
* ``export`` — ``trajstore export``: samples as a Parquet dataset
"""

__all__: list[str] = []
