"""``trajstore demo``: the whole pipeline on simulated rollouts.

* ``_run``         — the demo's stages (ingest, materialize, read, train)
* ``_simulate``    — synthetic multi-turn rollouts in the wire format
* ``_train_stage`` — launches ``workers/trainer.py`` (megatron-core on CPU) as a child process
"""

__all__: list[str] = []
