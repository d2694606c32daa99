"""The write side's edges: everything that turns what a rollout worker has
into wire-format events and hands them to ``Store.append``.

* ``client``  — ``Writer``: batching, retrying, thread-safe; to a Store or over HTTP
* ``sinks``   — where a Writer's batches go (in-process Store, HTTP service)
* ``vllm``    — vLLM outputs (offline objects, OpenAI JSON) → generation events
* ``sglang``  — SGLang outputs (native ``/generate``, OpenAI JSON, their streams) → generation events
* ``service`` — the HTTP ingest service (``trajstore serve``; FastAPI)
* ``proxy``   — the OpenAI-compatible recording proxy (``trajstore proxy``)
* ``_sglang_proxy`` — the proxy in front of SGLang, and ``trajstore proxy --engine``
* ``jsonl``   — ``trajstore ingest FILE``: validate a whole JSONL file, then append it in batches
* ``arrow_body`` — the binary ``POST /v1/events`` body (Arrow IPC stream) the Writer sends by default
* ``_http``   — what service and proxy answer alike: error bodies, statuses, the bearer check, flags
* ``_event_dicts`` — client-side event dicts: ``trajectory_started``, torch → numpy, numpy in JSON

None of them validates or folds on its own: the core does (``trajstore.events``,
``trajstore.store``). The core never imports this package.
"""

from trajstore.ingest.client import TrajectoryWriter, Writer

__all__ = ["TrajectoryWriter", "Writer"]
