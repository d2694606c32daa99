"""Training lineage in OpenLineage: a training run's steps as a run event reading the store's samples.

    from openlineage.client import OpenLineageClient
    from trajstore.inspect.lineage_openlineage import emit_consumed_samples

    client = OpenLineageClient()            # its own config: OPENLINEAGE_URL, openlineage.yml, ...
    for step, batch in enumerate(reader):
        ...
        if step % 100 == 99:                 # every N steps: the steps since the last event
            emit_consumed_samples(store, run="grpo-a", first_step=step - 99, last_step=step,
                                  event_type="RUNNING", client=client)
    emit_consumed_samples(store, run="grpo-a", client=client)   # COMPLETE, the whole run

One OpenLineage ``RunEvent`` per call, with the ``openlineage-python`` client
(any of its transports: HTTP to Marquez, Kafka, a file, ...): the job is the
training run (namespace ``trajstore``, name the run), its run id a UUID
derived from the store and the run (every event of one training run shares
it, so a lineage server shows them as one run), and one input dataset: the
store's samples (namespace the store's URL without credentials, name
``samples`` or ``projection/NAME``) with the standard ``inputStatistics``
facet (rows read: the consumed samples). A custom run facet,
``trajstore_training``, carries the step range, the number of steps, of
consumed samples and of distinct samples, and the digest over the consumed
rows that ``lineage_mlflow`` logs too. OpenLineage draws the pipeline graph
(rollouts → store → training run) in Marquez, DataHub and the like; the store
answers everything per step and per sample (docs/sql.md, "Training
lineage"). Needs ``openlineage-python`` (``pip install
'trajstore[openlineage]'``).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import text

from trajstore.inspect.lineage_mlflow import consumed_rows

__all__ = ["FACET_NAME", "emit_consumed_samples", "run_event"]

FACET_NAME = "trajstore_training"
"""The key of the custom run facet."""

# URNs (valid URIs, as OpenLineage asks of both): the project publishes no schema host
_PRODUCER = "urn:trajstore"
_FACET_SCHEMA = "urn:trajstore:facet:TrajstoreTrainingRunFacet:1"


def _openlineage() -> Any:
    try:
        import attr
        from openlineage.client import event_v2
        from openlineage.client.generated.base import RunFacet
        from openlineage.client.generated.input_statistics_input_dataset import InputStatisticsInputDatasetFacet
    except ImportError as e:
        raise ImportError("OpenLineage interop needs the extra: pip install 'trajstore[openlineage]' "
                          "(openlineage-python)") from e
    return attr, event_v2, RunFacet, InputStatisticsInputDatasetFacet


_FACET_CLASS: Any = None


def _facet_class() -> Any:
    """The ``trajstore_training`` run facet (an ``attrs`` class, as OpenLineage's own)."""
    global _FACET_CLASS
    if _FACET_CLASS is None:
        attr, _, RunFacet, _ = _openlineage()

        @attr.define
        class TrajstoreTrainingRunFacet(RunFacet):
            """The steps of a training run this event covers and what they consumed."""

            run: str = attr.field()
            firstStep: int | None = attr.field(default=None)  # noqa: N815 - OpenLineage's JSON casing
            lastStep: int | None = attr.field(default=None)  # noqa: N815
            numSteps: int = attr.field(default=0)  # noqa: N815
            numSamples: int = attr.field(default=0)  # noqa: N815
            numDistinctSamples: int = attr.field(default=0)  # noqa: N815
            digest: str = attr.field(default="")

            @staticmethod
            def _get_schema() -> str:
                return _FACET_SCHEMA

        _FACET_CLASS = TrajstoreTrainingRunFacet
    return _FACET_CLASS


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a SQLAlchemy URL: shown as given
        return url


def _projection(store: Any, run: str, first_step: int | None, last_step: int | None) -> str | None:
    """The projection the run's steps in the range named (the first one's; None: the default samples)."""
    q = ("SELECT projection FROM lineage_steps WHERE run = :run"
         + (" AND step >= :first" if first_step is not None else "")
         + (" AND step <= :last" if last_step is not None else "") + " ORDER BY step, rank LIMIT 1")
    with store.log.read_engine.connect() as conn:
        row = conn.execute(text(q), {"run": run, "first": first_step, "last": last_step}).first()
    return None if row is None else row[0]


def run_event(store: Any, *, run: str, first_step: int | None = None, last_step: int | None = None,
              event_type: str = "COMPLETE", run_id: str | None = None, job_namespace: str = "trajstore",
              job_name: str | None = None) -> Any:
    """The OpenLineage ``RunEvent`` of the samples ``run``'s standing steps in
    ``[first_step, last_step]`` consumed (the module doc), not emitted.
    ``event_type``: START, RUNNING, COMPLETE, ABORT, FAIL or OTHER. ``run_id``:
    default a UUID derived from the store's URL and ``run``."""
    _, ev, _, InputStatistics = _openlineage()
    try:
        state = ev.RunState[event_type.upper()]
    except KeyError:
        raise ValueError(f"event_type must be one of {', '.join(s.name for s in ev.RunState)}, "
                         f"got {event_type!r}") from None
    url = _safe_url(store.url)
    rows = consumed_rows(store, run=run, first_step=first_step, last_step=last_step)
    steps = sorted({r[0] for r in rows})
    facet = _facet_class()(
        run=run, firstStep=steps[0] if steps else first_step, lastStep=steps[-1] if steps else last_step,
        numSteps=len(steps), numSamples=len(rows), numDistinctSamples=len({(r[3], r[4]) for r in rows}),
        digest=hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:36],
        producer=_PRODUCER)
    projection = _projection(store, run, first_step, last_step)
    dataset = ev.InputDataset(
        namespace=url, name="samples" if projection is None else f"projection/{projection}",
        inputFacets={"inputStatistics": InputStatistics(rowCount=len(rows), producer=_PRODUCER)})
    return ev.RunEvent(
        eventType=state, eventTime=datetime.now(timezone.utc).isoformat(),
        run=ev.Run(runId=run_id or str(uuid.uuid5(uuid.NAMESPACE_URL, f"{url}#{run}")),
                   facets={FACET_NAME: facet}),
        job=ev.Job(namespace=job_namespace, name=job_name or run), inputs=[dataset], outputs=[],
        producer=_PRODUCER)


def emit_consumed_samples(store: Any, *, run: str, first_step: int | None = None, last_step: int | None = None,
                          event_type: str = "COMPLETE", client: Any = None, run_id: str | None = None,
                          job_namespace: str = "trajstore", job_name: str | None = None) -> dict[str, Any]:
    """Emit ``run_event(...)`` with ``client`` (an ``OpenLineageClient``; None: one
    configured the client's own way, from ``OPENLINEAGE_URL``, ``openlineage.yml``
    or ``OPENLINEAGE__TRANSPORT__*``). Returns what was emitted: ``run_id``,
    ``event_type``, ``dataset`` (namespace/name) and the facet's fields."""
    event = run_event(store, run=run, first_step=first_step, last_step=last_step, event_type=event_type,
                      run_id=run_id, job_namespace=job_namespace, job_name=job_name)
    if client is None:
        from openlineage.client import OpenLineageClient

        client = OpenLineageClient()
    client.emit(event)
    facet = event.run.facets[FACET_NAME]
    return {"run_id": event.run.runId, "event_type": event.eventType.value,
            "dataset": f"{event.inputs[0].namespace}/{event.inputs[0].name}",
            "first_step": facet.firstStep, "last_step": facet.lastStep, "num_steps": facet.numSteps,
            "num_samples": facet.numSamples, "num_distinct_samples": facet.numDistinctSamples,
            "digest": facet.digest}
