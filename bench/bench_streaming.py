"""SampleReader against MosaicML Streaming on the same samples, side by side in one run.

    pip install -e .[bench]      # mosaicml-streaming (see the note in pyproject.toml)
    PYTHONPATH=. .venv/bin/python bench/bench_streaming.py [--samples 256] [--rounds 3] [--out FILE]

The samples are those of the RL load (``bench_pipeline.py``): each
trajectory is 4 turns of 500 output + 100 observation tokens after a
100-token prompt, folded into one sample of 2,400 tokens with 48 x 8 routes
(uint8). They are written twice, before any clock starts:

* as a trajstore store (``store.append`` of the arrays, ``store.materialize()``);
* as an MDS dataset with ``streaming.MDSWriter``, one row per ``Sample`` with
  every field (arrays as ``ndarray:<dtype>`` with their shape, no compression,
  64 MiB shards: Streaming's defaults otherwise).

Each round reads every sample once from each, warm (page cache), one process,
interleaved: ``SampleReader(batch_size=8)`` (a fresh reader per epoch, as a
trainer resumes) and a local ``streaming.StreamingDataset`` (no remote, no
shuffle) iterated one epoch. Two consumers: ``delivered`` counts the tokens
of each sample's arrays (what both hand the trainer: numpy arrays), and
``touched`` also reads one byte of every 4 KiB page of every array, so the
reader's memory-mapped views pay for their page faults as Streaming's
``read()`` copies pay for theirs. Medians of ``--rounds``; wall and CPU
seconds (this process, all threads).

Streaming's package imports torchvision in its vision datasets at import
time; where torchvision cannot load (its CUDA wheel beside a CPU torch, as
on this machine), a stub stands in for it: the MDS writer and
``StreamingDataset`` never use torchvision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import trajstore  # noqa: E402
from bench_pipeline import arrays_load  # noqa: E402
from trajstore.reader import SampleReader  # noqa: E402

PAGE = 4096


def import_streaming():
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to load it: stub what streaming.vision imports
        # what streaming imports from transformers first, while torchvision is still absent
        import transformers.feature_extraction_utils  # noqa: F401
        import transformers.models.auto.tokenization_auto  # noqa: F401
        import transformers.tokenization_utils_base  # noqa: F401

        for name in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[name]
        tv = types.ModuleType("torchvision")
        tv.datasets = types.ModuleType("torchvision.datasets")
        tv.transforms = types.ModuleType("torchvision.transforms")
        tv.transforms.functional = types.ModuleType("torchvision.transforms.functional")
        tv.datasets.VisionDataset = type("VisionDataset", (), {})
        tv.datasets.CIFAR10 = type("CIFAR10", (), {})
        tv.transforms.functional.to_tensor = lambda x: x
        sys.modules.update({"torchvision": tv, "torchvision.datasets": tv.datasets,
                            "torchvision.transforms": tv.transforms,
                            "torchvision.transforms.functional": tv.transforms.functional})
    import streaming

    return streaming


ARRAYS = {"prompt_ids": "int32", "response_ids": "int32", "loss_mask": "uint8", "rollout_logprobs": "float32",
          "logprobs_mask": "uint8", "token_model_versions": "int32", "routed_experts": "uint8",
          "routed_experts_mask": "uint8"}
SCALARS = {"trajectory_id": "str", "group_id": "str", "sample_index": "int", "is_last_step": "int",
           "status": "str", "finish_reason": "str", "reward": "float64", "min_model_version": "int",
           "max_model_version": "int"}


def build(d: str, n: int, streaming) -> tuple[trajstore.Store, str, int]:
    store = trajstore.connect(f"sqlite:///{d}/store.db", payload=f"{d}/payload")
    for start in range(0, n, 16):
        store.append([e for t in arrays_load_range(start, min(n, start + 16)) for e in t])
    store.materialize()
    mds = f"{d}/mds"
    columns = {k: f"ndarray:{v}" for k, v in ARRAYS.items()} | SCALARS
    tokens = 0
    with streaming.MDSWriter(out=mds, columns=columns, compression=None) as w:
        for s in store.samples():
            tokens += s.num_tokens
            row = {k: np.ascontiguousarray(getattr(s, k)).view(v) if getattr(s, k).dtype == np.bool_
                   else getattr(s, k) for k, v in ARRAYS.items()}
            row.update(trajectory_id=s.trajectory_id, group_id=s.group_id or "", sample_index=s.sample_index,
                       is_last_step=int(s.is_last_step), status=s.status, finish_reason=s.finish_reason or "",
                       reward=float(s.reward or 0.0), min_model_version=s.min_model_version,
                       max_model_version=s.max_model_version)
            w.write(row)
    return store, mds, tokens


def arrays_load_range(lo: int, hi: int) -> list[list[dict]]:
    """Trajectories lo..hi-1 of the pipeline load."""
    return arrays_load(hi - lo, start=lo)


def touch(arrays) -> int:
    """One byte of every page of each array (C-contiguous views)."""
    total = 0
    for a in arrays:
        flat = a.reshape(-1).view(np.uint8)
        total += int(flat[::PAGE].sum())
    return total


def read_trajstore(store, touched: bool) -> tuple[int, int]:
    samples = tokens = 0
    with SampleReader(store, batch_size=8) as reader:
        for batch in reader:
            for s in batch:
                samples += 1
                tokens += len(s.prompt_ids) + len(s.response_ids)
                if touched:
                    touch([getattr(s, k) for k in ARRAYS])
    return samples, tokens


def read_streaming(ds, touched: bool) -> tuple[int, int]:
    samples = tokens = 0
    for row in ds:
        samples += 1
        tokens += len(row["prompt_ids"]) + len(row["response_ids"])
        if touched:
            touch([row[k] for k in ARRAYS])
    return samples, tokens


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tmp", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    streaming = import_streaming()
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        t0 = time.perf_counter()
        store, mds, tokens = build(d, args.samples, streaming)
        build_s = time.perf_counter() - t0
        ds = streaming.StreamingDataset(local=mds, remote=None, shuffle=False, batch_size=8)
        runs = {}
        for touched in (False, True):
            kind = "touched" if touched else "delivered"
            runs[f"trajstore SampleReader, {kind}"] = lambda t=touched: read_trajstore(store, t)
            runs[f"Streaming StreamingDataset, {kind}"] = lambda t=touched: read_streaming(ds, t)
        for run in runs.values():  # warm both (page cache, Streaming's shard index and shared memory)
            assert run() == (args.samples, tokens)
        for _ in range(args.rounds):
            for name, run in runs.items():
                t, c = time.perf_counter(), time.process_time()
                got = run()
                wall.setdefault(name, []).append(time.perf_counter() - t)
                cpu.setdefault(name, []).append(time.process_time() - c)
                assert got == (args.samples, tokens), (name, got)
        payload_mb = sum(os.path.getsize(f"{d}/payload/{f}") for f in os.listdir(f"{d}/payload")
                         if f.startswith("samples-")) / 2**20
        mds_mb = sum(f.stat().st_size for f in Path(mds).rglob("*.mds")) / 2**20
        store.close()
    med_w = {k: statistics.median(v) for k, v in wall.items()}
    med_c = {k: statistics.median(v) for k, v in cpu.items()}
    out: dict = {"samples": args.samples, "tokens": tokens, "rounds": args.rounds, "build_s": round(build_s, 1),
                 "trajstore_sample_segments_mib": round(payload_mb, 1), "mds_mib": round(mds_mb, 1),
                 "streaming_version": streaming.__version__, "cpus": os.cpu_count(), "paths": {}}
    for k in runs:
        out["paths"][k] = {"wall_s": round(med_w[k], 4), "cpu_s": round(med_c[k], 4),
                           "samples_per_s": round(args.samples / med_w[k], 1),
                           "tokens_per_s": round(tokens / med_w[k]),
                           "tokens_per_cpu_s": round(tokens / med_c[k])}
    for kind in ("delivered", "touched"):
        a, b = f"trajstore SampleReader, {kind}", f"Streaming StreamingDataset, {kind}"
        out[f"ratio_{kind}"] = {"wall": round(med_w[b] / med_w[a], 2), "cpu": round(med_c[b] / med_c[a], 2)}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return out


if __name__ == "__main__":
    main()
