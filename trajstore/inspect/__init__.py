"""Looking at a store: SQL views, the read-only SQL console, the HTML report
and the Parquet export.

* ``views``  — the inspection views' SQL (created by migration 0002) and the reader role
* ``sql``    — ``trajstore sql``: read-only queries over those views
* ``report`` — ``trajstore report``: the run view, a static page (OUT_DIR) or live (``--serve``)
* ``_panels`` — the report's panels: their SQL over the views and the run aggregates, and their
  plotly figures (``_panels_run``, ``_panels_tokens``, ``_panels_lineage``; drawn with ``_figures``)
* ``_step_panels`` — the panels per training step and per task, response length over time, and
  the trajectories to look at (registered by ``_panels``)
* ``_timeaxis`` — the width of the over-time panels' buckets
* ``_trace``  — the trace view: one trajectory's calls and samples, token by token
* ``_live``   — ``trajstore report --serve``: the live page over HTTP, read-only, behind a token
* ``export`` — ``trajstore export``: samples as a Parquet dataset
* ``lineage_mlflow`` — a training run's consumed samples as an MLflow dataset input
* ``lineage_openlineage`` — the same as OpenLineage run events (Marquez, DataHub, ...)
"""

__all__: list[str] = []
