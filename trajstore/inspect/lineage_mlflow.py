"""Training lineage in MLflow: the samples a run consumed, as an MLflow dataset input.

    from trajstore.inspect.lineage_mlflow import log_consumed_samples

    with mlflow.start_run():
        ...
        log_consumed_samples(store, run="grpo-a", first_step=0, last_step=99)

``mlflow.log_input`` of one dataset per call: its source names the store (the
URL without credentials), the run and the step range; its digest is SHA-256
over the consumed ``(step, rank, attempt, trajectory_id, sample_index)`` rows
(standing attempts, in order), so the same consumption gives the same digest
whatever store it is read from, and a redone step changes it. The input's
tags carry the step range and the sample counts. MLflow shows which data a
training run used; the store answers everything below that (docs/sql.md,
"Training lineage"). Needs ``mlflow`` or ``mlflow-skinny``
(``pip install 'trajstore[mlflow]'``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from sqlalchemy import text

__all__ = ["consumed_rows", "log_consumed_samples"]


def _mlflow() -> Any:
    try:
        import mlflow
        from mlflow.data.dataset_source import DatasetSource
    except ImportError as e:
        raise ImportError("MLflow interop needs the extra: pip install 'trajstore[mlflow]' "
                          "(mlflow or mlflow-skinny)") from e
    return mlflow, DatasetSource


def consumed_rows(store: Any, *, run: str, first_step: int | None = None,
                  last_step: int | None = None) -> list[tuple[int, int, int, str, int]]:
    """``(step, rank, attempt, trajectory_id, sample_index)`` of every sample the
    standing steps of ``run`` in ``[first_step, last_step]`` consumed, in (step,
    rank, order consumed)."""
    q = ("SELECT step, rank, attempt, trajectory_id, sample_index FROM sample_consumption WHERE run = :run"
         + (" AND step >= :first" if first_step is not None else "")
         + (" AND step <= :last" if last_step is not None else "")
         + " ORDER BY step, rank, ordinal")
    with store.log.read_engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(q), {"run": run, "first": first_step, "last": last_step})]


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a SQLAlchemy URL: shown as given
        return url


def _source_class() -> type:
    _, DatasetSource = _mlflow()

    class TrajstoreDatasetSource(DatasetSource):
        """A trajstore store's samples consumed by one run's steps (an MLflow dataset source)."""

        def __init__(self, url: str, run: str, first_step: int | None, last_step: int | None) -> None:
            self.url, self.run, self.first_step, self.last_step = url, run, first_step, last_step

        @staticmethod
        def _get_source_type() -> str:
            return "trajstore"

        def load(self, **kwargs: Any) -> Any:
            from trajstore.store import connect

            return connect(self.url, create=False)

        @staticmethod
        def _can_resolve(raw_source: Any) -> bool:
            return False

        @classmethod
        def _resolve(cls, raw_source: Any) -> "TrajstoreDatasetSource":
            raise NotImplementedError

        def to_dict(self) -> dict[str, Any]:
            return {"url": self.url, "run": self.run, "first_step": self.first_step, "last_step": self.last_step}

        @classmethod
        def from_dict(cls, source_dict: dict[str, Any]) -> "TrajstoreDatasetSource":
            return cls(source_dict["url"], source_dict["run"], source_dict.get("first_step"),
                       source_dict.get("last_step"))

    return TrajstoreDatasetSource


def log_consumed_samples(store: Any, *, run: str, first_step: int | None = None, last_step: int | None = None,
                         context: str = "training", name: str | None = None) -> dict[str, Any]:
    """``mlflow.log_input`` of the samples ``run``'s standing steps in ``[first_step,
    last_step]`` consumed, into the active MLflow run (one is started if none is).
    Returns what was logged: ``name``, ``digest``, ``num_samples`` (rows),
    ``num_distinct_samples``, ``num_steps``, ``first_step``, ``last_step``."""
    mlflow, _ = _mlflow()
    from mlflow.data.meta_dataset import MetaDataset

    rows = consumed_rows(store, run=run, first_step=first_step, last_step=last_step)
    digest = hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()
    steps = sorted({r[0] for r in rows})
    info = {"name": name or f"trajstore:{run}", "digest": digest[:36], "num_samples": len(rows),
            "num_distinct_samples": len({(r[3], r[4]) for r in rows}), "num_steps": len(steps),
            "first_step": steps[0] if steps else first_step, "last_step": steps[-1] if steps else last_step}
    source = _source_class()(_safe_url(store.url), run, first_step, last_step)
    dataset = MetaDataset(source=source, name=info["name"], digest=info["digest"])
    tags = {k: str(v) for k, v in info.items() if k not in ("name", "digest")}
    mlflow.log_input(dataset, context=context, tags=tags)
    return info
