"""The write side's edges: everything that turns what a rollout worker has
into wire-format events and hands them to ``Store.append``.

* ``client``  — ``Writer``: batching, retrying, thread-safe; to a Store or over HTTP
* ``sinks``   — where a Writer's batches go (in-process Store, HTTP service)
* ``vllm``    — vLLM outputs (offline objects, OpenAI JSON) → generation events
* ``sglang``  — SGLang outputs (native ``/generate``, OpenAI JSON, their streams) → generation events
* ``_openai_stream`` — the OpenAI stream accumulation both engines' stream accumulators specialize
* ``service`` — the HTTP ingest service: the app (``make_app``), its settings
  (``ServeConfig``), ``trajstore serve``; FastAPI. It composes:

  * ``_group_commit`` — concurrent requests coalesced into one ``store.append`` (threads only)
  * ``_body``       — a body read off raw ASGI, the byte budget on bodies in flight, the Arrow body parsed
  * ``_json_body``  — the JSON body, long integer arrays scanned straight to numpy
  * ``_metrics``    — the service's Prometheus metrics (multiprocess under ``--workers``)
* ``proxy/``  — the OpenAI-compatible recording proxy (``trajstore proxy``) in front of vLLM
  or SGLang (``proxy/_sglang``)
* ``verl``    — verl's agent-loop worker and LLM client recording each episode's engine calls
* ``skyrl``   — SkyRL's generator and inference-engine client recording theirs
  (``_episodes``: the recorder both share)
* ``jsonl``   — ``trajstore ingest FILE``: validate a whole JSONL file, then append it in batches
* ``arrow_body`` — the binary ``POST /v1/events`` body (Arrow IPC stream) the Writer sends by default
* ``_http``   — what service and proxy answer alike: error bodies, the one error<->status
  table (``ERROR_STATUS``; ``sinks`` reads it back), the bearer check, flags
* ``_event_dicts`` — client-side event dicts: ``trajectory_started``, torch → numpy, numpy in JSON

None of them validates or folds on its own: the core does (``trajstore.events``,
``trajstore.store``). The core never imports this package.
"""

from trajstore.ingest.client import TrajectoryWriter, Writer

__all__ = ["TrajectoryWriter", "Writer"]
