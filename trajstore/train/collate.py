"""Collation of samples into training tensors, and the torch ``SampleDataset``.

This is the reader's torch edge: the core (``trajstore.reader``) never
imports torch. Arrays are filled in numpy (routes stay uint8/uint16) and
handed to torch zero-copy at the end.

Each sample is laid out as its full sequence ``prompt + response``;
response-aligned fields (``loss_mask``, ``rollout_logprobs``,
``token_model_versions``, ``token_rewards``) sit at the positions of the
response tokens they describe, unshifted (``loss_mask`` is 0 on the prompt).
Shift for next-token prediction in the loss, as usual.

Layouts:
    padded  one row per sample, ``[B, S]``, padding on the left or right
    packed  all samples back to back in one row ``[1, T]`` (THD), with
            ``cu_seqlens`` ``[B+1]`` and positions restarting per sample

Shape suffixes:
    B  samples in the batch
    S  positions per row (padded) or the packed length T (packed: one row)
    L  recorded MoE layers
    K  top-k experts per token
    N  number of sequences (B) plus one, for offsets
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Literal, Sequence

import numpy as np
import torch

from trajstore.errors import ValidationError
from trajstore.sample import Sample

__all__ = ["collate", "collate_arrays", "to_tensors", "SampleDataset"]

Layout = Literal["padded", "packed"]


def collate(samples: Sequence[Sample], *, layout: Layout = "padded", padding_side: str = "right",
            pad_to_multiple_of: int = 1, pad_token_id: int = 0) -> dict[str, Any]:
    """A batch as torch tensors; see ``collate_arrays`` for the keys."""
    return to_tensors(collate_arrays(samples, layout=layout, padding_side=padding_side,
                                     pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id))


def collate_arrays(samples: Sequence[Sample], *, layout: Layout = "padded", padding_side: str = "right",
                   pad_to_multiple_of: int = 1, pad_token_id: int = 0) -> dict[str, Any]:
    """A batch as numpy arrays.

    Keys (padded ``[B, S]``; packed ``[1, T]``):
      input_ids int64, position_ids int64, attention_mask bool (False = padding),
      loss_mask float32, rollout_logprobs float32, logprobs_mask bool (True where
      ``rollout_logprobs`` holds a logprob the engine gave: the sample's
      ``logprobs_mask`` when recorded, else its loss-masked response tokens;
      False on prompts, observations and padding), token_model_versions int32
      (-1 off the generated tokens), token_rewards float32 (0 where none),
      routed_experts uint8/uint16 ``[.., L, K]`` and routed_experts_mask bool
      (True = no route to replay: not captured, padding, or a sample without
      routes), both absent when no sample has routes;
      per sample ``[B]``: rewards float32 (NaN when None), prompt_lens and
      seq_lens int32, and the lists trajectory_ids, sample_indices, group_ids,
      finish_reasons (str or None per sample);
      packed only: cu_seqlens int32 ``[B+1]``.
    """
    if layout not in ("padded", "packed"):
        raise ValidationError(f"layout must be 'padded' or 'packed', got {layout!r}", rule="collate")
    if padding_side not in ("left", "right"):
        raise ValidationError(f"padding_side must be 'left' or 'right', got {padding_side!r}", rule="collate")
    if not samples:
        raise ValidationError("cannot collate an empty batch", rule="collate")
    seq_lens_B = np.array([s.num_tokens for s in samples], dtype=np.int32)
    rows_B, starts_B, shape = _placement(seq_lens_B, layout, padding_side, pad_to_multiple_of)
    out = _token_fields(samples, rows_B, starts_B, shape, pad_token_id)
    out.update(_route_fields(samples, rows_B, starts_B, shape))
    out.update(_sample_fields(samples, seq_lens_B))
    if layout == "packed":
        cu_seqlens_N = np.zeros(len(samples) + 1, dtype=np.int32)
        np.cumsum(seq_lens_B, out=cu_seqlens_N[1:])
        out["cu_seqlens"] = cu_seqlens_N
    return out


def _placement(seq_lens_B: np.ndarray, layout: str, padding_side: str,
               multiple: int) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """Row and first position of each sample, and the batch's [rows, positions]."""
    def round_up(n: int) -> int:
        return -(-n // multiple) * multiple

    if layout == "packed":
        starts_B = np.zeros(len(seq_lens_B), dtype=np.int64)
        np.cumsum(seq_lens_B[:-1], out=starts_B[1:])
        return np.zeros(len(seq_lens_B), dtype=np.int64), starts_B, (1, round_up(int(seq_lens_B.sum())))
    seq_len = round_up(int(seq_lens_B.max()))
    starts_B = seq_len - seq_lens_B.astype(np.int64) if padding_side == "left" else np.zeros(len(seq_lens_B), np.int64)
    return np.arange(len(seq_lens_B)), starts_B, (len(seq_lens_B), seq_len)


def _token_fields(samples: Sequence[Sample], rows_B: np.ndarray, starts_B: np.ndarray,
                  shape: tuple[int, int], pad_token_id: int) -> dict[str, np.ndarray]:
    input_ids_BS = np.full(shape, pad_token_id, dtype=np.int64)
    position_ids_BS = np.zeros(shape, dtype=np.int64)
    attention_mask_BS = np.zeros(shape, dtype=np.bool_)
    loss_mask_BS = np.zeros(shape, dtype=np.float32)
    logprobs_BS = np.zeros(shape, dtype=np.float32)
    logprobs_mask_BS = np.zeros(shape, dtype=np.bool_)
    versions_BS = np.full(shape, -1, dtype=np.int32)
    token_rewards_BS = np.zeros(shape, dtype=np.float32)
    positions = np.arange(shape[1], dtype=np.int64)
    for s, row, start in zip(samples, rows_B, starts_B):
        prompt_len, seq_len = len(s.prompt_ids), s.num_tokens
        whole, response = slice(start, start + seq_len), slice(start + prompt_len, start + seq_len)
        input_ids_BS[row, start: start + prompt_len] = s.prompt_ids
        input_ids_BS[row, response] = s.response_ids
        position_ids_BS[row, whole] = positions[:seq_len]
        attention_mask_BS[row, whole] = True
        loss_mask_BS[row, response] = s.loss_mask
        logprobs_BS[row, response] = s.rollout_logprobs
        logprobs_mask_BS[row, response] = s.logprobs_mask
        versions_BS[row, response] = s.token_model_versions
        if s.token_rewards is not None:
            token_rewards_BS[row, response] = s.token_rewards
    return {"input_ids": input_ids_BS, "position_ids": position_ids_BS, "attention_mask": attention_mask_BS,
            "loss_mask": loss_mask_BS, "rollout_logprobs": logprobs_BS, "logprobs_mask": logprobs_mask_BS,
            "token_model_versions": versions_BS,
            "token_rewards": token_rewards_BS}


def _route_fields(samples: Sequence[Sample], rows_B: np.ndarray, starts_B: np.ndarray,
                  shape: tuple[int, int]) -> dict[str, np.ndarray]:
    with_routes = [s for s in samples if s.routed_experts is not None]
    if not with_routes:
        return {}
    layer_topk = {s.routed_experts.shape[1:] for s in with_routes}
    if len(layer_topk) > 1:
        raise ValidationError(f"samples disagree on routes [layers, topk]: {sorted(layer_topk)}", rule="collate")
    dtype = np.uint16 if any(s.routed_experts.dtype == np.uint16 for s in with_routes) else np.uint8
    # Uninitialised, then zeroed only where no route is copied: routes are the
    # bulk of a batch, and writing them twice would cost a second pass.
    routes_BSLK = np.empty(shape + next(iter(layer_topk)), dtype=dtype)
    routes_mask_BS = np.ones(shape, dtype=np.bool_)
    copied_BS = np.zeros(shape, dtype=np.bool_)
    for s, row, start in zip(samples, rows_B, starts_B):
        if s.routed_experts is not None:
            whole = slice(start, start + s.num_tokens)
            routes_BSLK[row, whole] = s.routed_experts
            routes_mask_BS[row, whole] = s.routed_experts_mask
            copied_BS[row, whole] = True
    routes_BSLK[~copied_BS] = 0
    return {"routed_experts": routes_BSLK, "routed_experts_mask": routes_mask_BS}


def _sample_fields(samples: Sequence[Sample], seq_lens_B: np.ndarray) -> dict[str, Any]:
    return {
        "rewards": np.array([np.nan if s.reward is None else s.reward for s in samples], dtype=np.float32),
        "prompt_lens": np.array([len(s.prompt_ids) for s in samples], dtype=np.int32),
        "seq_lens": seq_lens_B,
        "trajectory_ids": [s.trajectory_id for s in samples],
        "sample_indices": [s.sample_index for s in samples],
        "group_ids": [s.group_id for s in samples],
        "finish_reasons": [s.finish_reason for s in samples],
    }


def to_tensors(arrays: dict[str, Any]) -> dict[str, Any]:
    """numpy arrays to torch tensors without copying; lists stay lists."""
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}


DATASET_STATE_FORMAT = "trajstore.sample_dataset"


class SampleDataset(torch.utils.data.IterableDataset):
    """Collated batches of one data-parallel rank, for a ``torch.utils.data.DataLoader``.

    Use ``DataLoader(dataset, batch_size=None)``: batching is the reader's.
    With ``num_workers=n`` worker i collates global steps i, i+n, ... and the
    DataLoader's round-robin keeps the order.

    Resuming, two ways:

    * torchdata's ``StatefulDataLoader(dataset, batch_size=None, num_workers=n)``:
      the dataset follows its ``state_dict()`` / ``load_state_dict()``
      protocol, so ``loader.state_dict()`` (saved in the trainer's checkpoint)
      resumes exactly after the last batch the loader yielded, workers
      included (each worker's copy reports where it is; the loader keeps the
      snapshot of the batches it handed out), without re-reading anything.
    * A plain ``DataLoader``: each batch carries ``"reader_state"``, the
      reader state after it; save the one of the last batch you trained on and
      pass it to ``load_state_dict`` on restart (workers prefetch, so the
      dataset object in the main process cannot know what was consumed).

    ``current_model_version`` (the trainer's policy, for staleness; its old
    name ``current_version`` still works, deprecated) is read when iteration
    starts; to change it between steps, use a ``SampleReader`` directly.

    Training lineage: workers prefetch, so the dataset in the main process
    cannot know what the trainer consumed; ``record_step(step, batches, ...)``
    records the samples of the batches it is given (their ``trajectory_ids``
    and ``sample_indices``), see ``SampleReader.record_step``.
    """

    def __init__(self, url: str, config: Any = None, *, rank: int = 0, world_size: int = 1,
                 payload: str | None = None, current_model_version: int | None = None, layout: Layout = "padded",
                 padding_side: str = "right", pad_to_multiple_of: int = 1, current_version: int | None = None,
                 **fields: Any) -> None:
        from trajstore._util.deprecated import renamed
        from trajstore.reader import ReaderConfig, _settings

        current_model_version = renamed("current_version", "current_model_version", current_version,
                                         current_model_version, None)

        super().__init__()
        if not isinstance(url, str):  # a Store: workers reconnect by URL
            url, payload = url.url, url.payload.location
        self.url, self.payload = url, payload
        self.config = ReaderConfig(**_settings(type(self).__name__, config, fields))
        self.rank, self.world_size, self.current_model_version = rank, world_size, current_model_version
        self.collate_kwargs = {"layout": layout, "padding_side": padding_side, "pad_to_multiple_of": pad_to_multiple_of}
        self.state: dict[str, Any] | None = None  # the reader state iteration starts from
        self._position: dict[str, Any] | None = None  # the reader state after the last batch this copy yielded

    def state_dict(self) -> dict[str, Any]:
        """Where this copy of the dataset is (``StatefulDataLoader`` protocol): the
        reader state after the last batch it yielded, else the one it starts from."""
        position = self._position if self._position is not None else self.state
        return {"format": DATASET_STATE_FORMAT, "reader_state": position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next iteration after ``state``: a ``state_dict()`` of this
        dataset, or a batch's ``"reader_state"`` (a ``SampleReader`` state)."""
        if isinstance(state, dict) and state.get("format") == DATASET_STATE_FORMAT:
            state = state.get("reader_state")
        self.state, self._position = state, None

    def record_step(self, step: int, batches: Any, *, run: str, policy_version: int | None = None,
                    metrics: dict[str, float] | None = None, annotations: Any = None,
                    attempt: int | None = None) -> Any:
        """Record training step ``step`` of ``run`` for this rank: the samples of
        ``batches`` (one collated batch of this dataset, or a list of them for
        gradient accumulation), with ``metrics`` and ``annotations`` as
        ``SampleReader.record_step`` takes them (per-sample arrays of response
        length: unpad them first). ``policy_version`` defaults to the dataset's
        ``current_model_version``. Appends from the calling process (its own
        connection, opened on first use). Returns a ``RecordedStep``."""
        if isinstance(batches, dict):
            batches = [batches]
        keys = [(str(t), int(i)) for b in batches for t, i in zip(b["trajectory_ids"], b["sample_indices"])]
        recorder = self.__dict__.get("_lineage")
        if recorder is None:
            from trajstore.lineage import store_recorder
            from trajstore.store import connect

            store = connect(self.url, payload=self.payload, migrate=False, create=False)
            recorder = self._lineage = store_recorder(store, rank=self.rank, world_size=self.world_size,
                                                      projection=self.config.projection)
        version = self.current_model_version if policy_version is None else policy_version
        return recorder.record(step, run=run, policy_version=version, metrics=metrics,  # type: ignore[arg-type]
                               annotations=annotations, attempt=attempt, samples=keys)

    def __getstate__(self) -> dict[str, Any]:
        # workers get the settings, never the main process's lineage connection
        return {k: v for k, v in self.__dict__.items() if k != "_lineage"}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from trajstore.reader import SampleReader

        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        with SampleReader(self.url, rank=self.rank, world_size=self.world_size,
                          current_model_version=self.current_model_version, payload=self.payload,
                          **dataclasses.asdict(self.config)) as reader:
            if self.state is not None:
                reader.load_state_dict(self.state)
            for step, batch in reader.iter_steps(worker, num_workers):
                tensors = collate(batch, **self.collate_kwargs) if batch else {}
                self._position = reader.state_dict()
                yield {**tensors, "step": step, "reader_state": self._position}
