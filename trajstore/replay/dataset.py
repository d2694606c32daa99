"""``ReplayDataset``: ``SampleDataset`` reading through replay servers (torch edge)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

import torch

from trajstore.replay.client import ReplayReader
from trajstore.train.collate import SampleDataset, collate

__all__ = ["ReplayDataset"]


class ReplayDataset(SampleDataset):
    """``SampleDataset`` whose workers read through replay servers: same batches,
    same ``state_dict()`` / ``load_state_dict()`` (``StatefulDataLoader``), same
    per-batch ``"reader_state"``; ``locations`` and ``token`` as for
    ``ReplayReader``, the rest as for ``SampleDataset``."""

    def __init__(self, locations: str | Sequence[str], config: Any = None, *, token: str | None = None,
                 retry_timeout_s: float = 60.0, **kwargs: Any) -> None:
        super().__init__(",".join(locations) if not isinstance(locations, str) else locations, config, **kwargs)
        self.token, self.retry_timeout_s = token, retry_timeout_s

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        with ReplayReader(self.url, token=self.token, rank=self.rank, world_size=self.world_size,
                          current_model_version=self.current_model_version,
                          retry_timeout_s=self.retry_timeout_s, **dataclasses.asdict(self.config)) as reader:
            if self.state is not None:
                reader.load_state_dict(self.state)
            for step, batch in reader.iter_steps(worker, num_workers):
                tensors = collate(batch, **self.collate_kwargs) if batch else {}
                self._position = reader.state_dict()
                yield {**tensors, "step": step, "reader_state": self._position}
