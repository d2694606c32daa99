"""Mutation fuzzing of wire-format events, shared by the store and
HTTP fuzz tests.

A *unit* is one simulated trajectory (``trajstore.demo._simulate``, small
arrays) under a fresh id with exactly one event mutated: wrong types,
huge/negative/NaN/inf numbers, deep nesting, lone surrogates, NUL, long
strings, overflowing base64 shapes, wrong dtypes, truncated base64, wrong
lengths, extra and missing fields, foreign trajectories, out-of-order seq.
Every mutation is JSON-encodable (NaN and lone surrogates included: Python's
json writes them), so the same units go through ``store.append`` and HTTP.

``run_fuzz(append, units)`` appends units in batches; an append is atomic, so
when it is refused the error's index names the culprit: its unit is recorded
as refused and the rest of the batch is appended again. Anything but a
ValidationError (``Refused`` over HTTP) propagates and fails the test.
"""

from __future__ import annotations

import base64
import copy
import io
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from trajstore.events._wire import encode_b64, encode_npy_b64
from trajstore.demo._simulate import RolloutConfig, trajectory_events

CONFIG = RolloutConfig(turns=2, prompt_tokens=6, output_tokens=4, observation_tokens=2, layers=2, topk=2,
                       num_experts=16, vocab=1000, mismatch_prob=0.3, abort_prob=0.3, fail_prob=0.1)


def _deep_list(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


def _deep_dict(depth: int) -> dict:
    root = node = {}
    for _ in range(depth):
        node["k"] = {}
        node = node["k"]
    return root


def _npy_header(header: str, data: bytes = b"") -> str:
    text = header.encode("latin1")
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    return base64.b64encode(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data).decode()


HOSTILE_SCALARS: list[Any] = [
    None, True, False, 0, -1, 1, 2**31 - 1, 2**31, -2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 10**30,
    -10**30, 10**400, 0.5, -0.0, 1e308, -1e308, 1e-320, math.nan, math.inf, -math.inf, "", "x", "x" * 300,
    "a\udc80", "\ud800", "\x00", "a\x00b", "😀" * 256, "generation", "AAAA", "====", "\u202e", [], {}, [[]],
    [None], ["a"], [1, "a"], [[1], [1, 2]], [math.nan], [2**64], {"b64": "AA==", "dtype": "uint8", "shape": [1]},
]


def hostile_value(rng: np.random.Generator) -> Any:
    k = int(rng.integers(0, len(HOSTILE_SCALARS) + 12))
    if k < len(HOSTILE_SCALARS):
        return copy.deepcopy(HOSTILE_SCALARS[k])
    k -= len(HOSTILE_SCALARS)
    return [
        lambda: _deep_list(int(rng.integers(30, 400))),
        lambda: _deep_dict(int(rng.integers(30, 400))),
        lambda: {"b64": "", "dtype": "uint8", "shape": [0, 2**62, 2**62]},
        lambda: {"b64": "AAAA", "dtype": "uint8", "shape": [2**32, 2**32, 3]},
        lambda: {"b64": "AAAA", "dtype": rng.choice(["object", "<U3", "complex64", "V8", "float128", "S1"]),
                 "shape": [3]},
        lambda: {"b64": "AAAA", "dtype": "uint8",
                 "shape": ["3", 3, None, [3.0], [-3], [True], {"a": 3}, [1] * 40][int(rng.integers(0, 8))]},
        lambda: _npy_header("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", b"\x00" * 8),
        lambda: _npy_header("{'descr': '<u1', 'fortran_order': False, 'shape': (4611686018427387904, 4), }"),
        lambda: _npy_header("{'descr': '<u1', 'fortran_order': False, 'shape': (10, 2, 2), }", b"\x01" * 7),
        lambda: _npy_header("{'descr': [('a', '<u1')], 'fortran_order': True, 'shape': (1, 1, 1), }", b"\x01"),
        lambda: base64.b64encode(rng.bytes(int(rng.integers(0, 40)))).decode(),
        lambda: [float(x) for x in rng.normal(size=int(rng.integers(0, 6)))],
    ][k]()


ARRAY_FIELDS = ("prompt_ids", "output_ids", "logprobs", "loss_mask", "token_rewards", "routed_experts")
MISSPELLED = ("logprob", "routed_expert", "prompt_id", "outputs_ids", "model_versions", "Reward", "traj_id", "seq ")


# The seed trajectories' arrays recur in every unit; their base64 forms are made
# once (np.save is most of make_units' time). Keyed by id(), the array kept alive.
_ENCODED: dict[int, tuple[np.ndarray, dict, str]] = {}


def _reencode(value: Any, rng: np.random.Generator) -> Any:
    """A valid array in one of the three ARRAY encodings (or as it is)."""
    if not isinstance(value, np.ndarray):
        return value
    k = int(rng.integers(0, 4))
    if k == 0:
        return value
    if k == 1:
        return value.tolist()
    cached = _ENCODED.get(id(value))
    if cached is None or cached[0] is not value:
        return encode_b64(value) if k == 2 else encode_npy_b64(value)
    if k == 2:
        return dict(cached[1], shape=list(cached[1]["shape"]))
    return cached[2]


def _mutate_array(value: np.ndarray, name: str, rng: np.random.Generator) -> Any:
    arr = np.array(value)
    k = int(rng.integers(0, 14))
    if k == 0 and arr.size:
        return arr[:-1]  # too short
    if k == 1:
        return np.concatenate([arr, arr[:1]]) if arr.size else arr.reshape(-1)[:0]  # too long
    if k == 2 and arr.size:
        arr = arr.astype(np.int64) if arr.dtype.kind in "iu" else arr.astype(np.float64)
        arr.reshape(-1)[int(rng.integers(0, arr.size))] = rng.choice([-1, 2**31, 70000, 16, 2**40])
        return arr
    if k == 3 and arr.size:
        arr = arr.astype(np.float64)
        arr.reshape(-1)[int(rng.integers(0, arr.size))] = rng.choice([math.nan, math.inf, -math.inf, 0.5, 1e39])
        return arr.tolist()
    if k == 4:
        enc = encode_b64(arr)
        enc["b64"] = enc["b64"][: max(0, len(enc["b64"]) - int(rng.integers(1, 6)))]  # truncated
        return enc
    if k == 5:
        enc = encode_b64(arr)
        enc["dtype"] = str(rng.choice(["uint16", "float32", "int8", "bool", "float16", "uint64", "int64"]))
        return enc
    if k == 6:
        enc = encode_b64(arr)
        enc["shape"] = list(enc["shape"])
        if enc["shape"]:
            i = int(rng.integers(0, len(enc["shape"])))
            enc["shape"][i] = int(rng.choice([0, 1, 2**31, 2**62, -1])) if rng.random() < 0.5 else enc["shape"][i] + 1
        return enc
    if k == 7:
        raw = base64.b64decode(encode_npy_b64(arr))
        cut = int(rng.integers(0, len(raw)))
        return base64.b64encode(raw[:cut] if rng.random() < 0.5 else raw + rng.bytes(cut % 7 + 1)).decode()
    if k == 8 and arr.ndim >= 1 and arr.size:
        return arr.reshape(-1)[:, None].tolist() if arr.ndim == 1 else arr.reshape(len(arr), -1)  # wrong ndim
    if k == 9:
        lst = arr.tolist()
        if isinstance(lst, list) and lst:
            lst[int(rng.integers(0, len(lst)))] = hostile_value(rng)
        return lst
    if k == 10:
        return arr.astype(np.float64) + 0.25  # non-integers
    if k == 11:
        return -arr if arr.dtype.kind != "u" else -arr.astype(np.int64)
    if k == 12:
        buf = io.BytesIO()
        np.save(buf, arr.astype(">u2") if arr.dtype.kind in "iu" else arr.astype(">f8"))
        return base64.b64encode(buf.getvalue()).decode()  # big-endian .npy: valid, other byte order
    return hostile_value(rng)


def mutate(event: dict, rng: np.random.Generator, other_tids: list[str]) -> tuple[dict, str]:
    """One mutated copy of ``event`` and the mutation's name."""
    ev = dict(event)
    k = int(rng.integers(0, 12))
    arrays = [f for f in ARRAY_FIELDS if f in ev]
    if k in (0, 1, 2, 3) and arrays:
        name = str(rng.choice(arrays))
        ev[name] = _mutate_array(ev[name], name, rng)
        return ev, f"array:{name}"
    if k == 4:
        key = str(rng.choice(list(ev)))
        ev[key] = hostile_value(rng)
        return ev, f"value:{key}"
    if k == 5:
        key = str(rng.choice(list(ev)))
        del ev[key]
        return ev, f"missing:{key}"
    if k == 6:
        key = str(rng.choice(MISSPELLED + ("metadata", "finish_reason", "event_id", "group_id", "num_experts")))
        ev[key] = ev.pop("logprobs") if key == "logprob" and "logprobs" in ev else hostile_value(rng)
        return ev, f"extra:{key}"
    if k == 7:
        ev["trajectory_id"] = str(rng.choice(other_tids + ["never-started", ev["trajectory_id"] + "\udc80",
                                                           ev["trajectory_id"] * 30]))
        return ev, "trajectory_id"
    if k == 8 and "seq" in ev:
        ev["seq"] = int(ev["seq"] + rng.choice([-1, 1, 2, -100, 2**31]))
        return ev, "seq"
    if k == 9:
        ev["type"] = [["generation"], "Generation", "", None, 5, {"g": 1}, "reward", "trajectory_finished",
                      "trajectory_started", "generation"][int(rng.integers(0, 10))]
        return ev, "type"
    if k == 10:
        meta = [lambda: {"x": math.nan}, lambda: {"x": "\x00"}, lambda: {"\udc80": 1}, lambda: {"x": "y" * 70000},
                lambda: _deep_dict(100), lambda: {"x": 10**20}, lambda: {"ok": [1, 2.5, None, "😀"]}, lambda: [],
                lambda: "meta", lambda: {"x": list(range(70000))}][int(rng.integers(0, 10))]()
        ev["metadata"] = meta
        return ev, "metadata"
    # k == 11 (or nothing else applied): a valid re-encoding plus a small numeric/string change
    for name in arrays:
        ev[name] = _reencode(ev[name], rng)
    key = str(rng.choice(["finish_reason", "event_id", "group_id", "status", "reward", "model_version",
                          "routed_experts_start", "num_experts"]))
    ev[key] = [None, "stop", "x" * 64, "x" * 65, "e\x00", "😀" * 255, "😀" * 256, 0, 3, 2**31 - 1, -1, 1e300,
               "completed", "done", 0.5][int(rng.integers(0, 15))]
    return ev, f"small:{key}"


def make_units(n: int, seed: int = 0) -> list[tuple[list[dict], str]]:
    """``n`` units: (events of one fresh trajectory with one event mutated, mutation name)."""
    rng = np.random.default_rng(seed)
    seeds = [trajectory_events(CONFIG, i) for i in range(64)]
    _ENCODED.clear()
    _ENCODED.update({id(v): (v, encode_b64(v), encode_npy_b64(v))
                     for evs in seeds for ev in evs for v in ev.values() if isinstance(v, np.ndarray)})
    units = []
    for u in range(n):
        tid = f"fz-{seed}-{u}"
        events = [dict(ev, trajectory_id=tid) for ev in seeds[u % len(seeds)]]
        i = int(rng.integers(0, len(events)))
        others = [f"fz-{seed}-{u - d}" for d in (1, 2) if u - d >= 0]
        events[i], name = mutate(events[i], rng, others)
        events = [ev if j == i else {k: _reencode(v, rng) for k, v in ev.items()} for j, ev in enumerate(events)]
        units.append((events, name))
    return units


class Refused(Exception):
    """A refusal seen over HTTP: the 4xx error body's index and rule."""

    def __init__(self, status: int, index: int | None, rule: str) -> None:
        super().__init__(f"{status} {rule} at {index}")
        self.status, self.index, self.rule = status, index, rule


@dataclass
class FuzzStats:
    units: int = 0
    mutated_events: int = 0
    accepted_units: int = 0
    refused_units: int = 0
    appended_events: int = 0
    appends: int = 0
    rules: Counter = field(default_factory=Counter)
    accepted_mutations: Counter = field(default_factory=Counter)


def run_fuzz(append: Callable[[list], Any], units: list[tuple[list[dict], str]], *, batch_units: int = 16,
             refusal: type[Exception]) -> FuzzStats:
    """Append ``units`` in batches; a refusal (``refusal`` with ``.index``/``.rule``) drops its unit."""
    stats = FuzzStats(units=len(units), mutated_events=len(units))
    for b in range(0, len(units), batch_units):
        pending = list(units[b:b + batch_units])
        while pending:
            events = [ev for unit, _ in pending for ev in unit]
            stats.appends += 1
            try:
                result = append(events)
            except refusal as e:
                index = e.index  # type: ignore[attr-defined]
                assert index is not None and 0 <= index < len(events), f"refusal without a valid index: {e}"
                stats.rules[e.rule] += 1  # type: ignore[attr-defined]
                offset = 0
                for j, (unit, _) in enumerate(pending):
                    if index < offset + len(unit):
                        del pending[j]
                        break
                    offset += len(unit)
                stats.refused_units += 1
                continue
            stats.accepted_units += len(pending)
            stats.appended_events += result
            stats.accepted_mutations.update(name for _, name in pending)
            pending = []
    return stats


def run_fuzz_concurrently(make_append: Callable[[], Any], units: list[tuple[list[dict], str]], *, clients: int,
                          refusal: type[Exception]) -> FuzzStats:
    """``run_fuzz`` over ``clients`` threads, each with its own ``make_append()``
    and every ``clients``-th unit (units are separate trajectories, so the
    threads never race on one); their stats summed. Concurrent requests also
    exercise the service's group commit with refused requests in the group."""
    from concurrent.futures import ThreadPoolExecutor

    shards = [units[k::clients] for k in range(clients)]
    with ThreadPoolExecutor(clients) as pool:
        parts = list(pool.map(lambda shard: run_fuzz(make_append(), shard, refusal=refusal), shards))
    total = FuzzStats()
    for part in parts:
        for name in ("units", "mutated_events", "accepted_units", "refused_units", "appended_events", "appends"):
            setattr(total, name, getattr(total, name) + getattr(part, name))
        total.rules.update(part.rules)
        total.accepted_mutations.update(part.accepted_mutations)
    return total


# -- training lineage events (SPEC "Training lineage") ------------------------------------------

LINEAGE_MISSPELLED = ("sample", "policy", "trainer_logprob", "advantage", "entropies", "metric", "ranks", "Run")


def mutate_lineage(event: dict, rng: np.random.Generator, known: list[tuple[str, int]]) -> tuple[dict, str]:
    """One mutated copy of a train_step or sample_annotation and the mutation's name."""
    ev = dict(event)
    k = int(rng.integers(0, 10))
    arrays = [f for f in ("trainer_logprobs", "advantages", "entropy") if isinstance(ev.get(f), np.ndarray)]
    if k in (0, 1) and arrays:
        name = str(rng.choice(arrays))
        ev[name] = _mutate_array(ev[name], name, rng)
        return ev, f"array:{name}"
    if k == 2:
        key = str(rng.choice(list(ev)))
        ev[key] = hostile_value(rng)
        return ev, f"value:{key}"
    if k == 3:
        key = str(rng.choice(list(ev)))
        del ev[key]
        return ev, f"missing:{key}"
    if k == 4:
        key = str(rng.choice(LINEAGE_MISSPELLED + ("metrics", "event_id", "projection", "attempt")))
        ev[key] = hostile_value(rng)
        return ev, f"extra:{key}"
    if k == 5:
        ev["metrics"] = [lambda: {"x": math.nan}, lambda: {"": 1.0}, lambda: {"\udc80": 1.0}, lambda: {"x": "1"},
                         lambda: {"x": True}, lambda: {f"m{i}": 1.0 for i in range(300)}, lambda: {"x": 10**400},
                         lambda: {"ok": 0.5}, lambda: [], lambda: {"x": {"y": 1.0}}][int(rng.integers(0, 10))]()
        return ev, "metrics"
    if k == 6 and ev["type"] == "train_step":
        samples = list(ev["samples"])
        choice = int(rng.integers(0, 7))
        if choice == 0:
            samples.append(["never-materialized", 0])
        elif choice == 1 and samples:
            samples.append(list(samples[0]))  # twice
        elif choice == 2:
            samples.append([known[int(rng.integers(0, len(known)))][0], 999])
        elif choice == 3:
            samples = [[t, i] for t, i in known[: int(rng.integers(0, 4))]]  # valid others
        elif choice == 4:
            samples.append({"trajectory_id": "x", "sample_index": 0})
        elif choice == 5:
            samples.append(["x", 0, 1])
        else:
            samples = "t1,0"
        ev["samples"] = samples
        return ev, "samples"
    if k == 7:
        key = str(rng.choice(["rank", "world_size", "policy_version", "attempt", "step", "sample_index"]))
        if key in ev or key in ("attempt",):
            ev[key] = [-1, 0, 1, 7, 2**31 - 1, 2**31, 2**63, 0.5, 1.0, "3"][int(rng.integers(0, 10))]
        return ev, f"int:{key}"
    if k == 8 and ev["type"] == "sample_annotation":
        if rng.random() < 0.5:
            ev["trajectory_id"], ev["sample_index"] = known[int(rng.integers(0, len(known)))]  # another length
        else:
            ev["trajectory_id"] = "never-materialized"
        return ev, "other_sample"
    for name in arrays:  # a valid re-encoding
        ev[name] = _reencode(ev[name], rng)
    if "advantages" in ev and rng.random() < 0.5:
        ev["advantages"] = [0.5, -1e30, 1e39, math.nan, 3][int(rng.integers(0, 5))]
    return ev, "reencoded"


def make_lineage_units(n: int, samples: list[tuple[str, int, int]], seed: int = 0
                       ) -> list[tuple[list[dict], str]]:
    """``n`` units: a train_step of one rank (its own step number, so units never
    share a key) naming up to 4 of ``samples`` (``(trajectory_id, sample_index,
    response_len)``, materialized), and an annotation for each, one event mutated."""
    rng = np.random.default_rng(seed)
    known = [(t, i) for t, i, _ in samples]
    units = []
    for u in range(n):
        picked = [samples[int(j)] for j in rng.choice(len(samples), size=min(len(samples), int(rng.integers(1, 5))),
                                                     replace=False)]
        st = {"type": "train_step", "run": f"fz-{seed}", "step": u, "rank": 0, "world_size": 1,
              "policy_version": int(rng.integers(0, 10)), "samples": [[t, i] for t, i, _ in picked],
              "metrics": {"loss": float(rng.normal())}}
        events = [st]
        for t, i, n_resp in picked:
            note = {"type": "sample_annotation", "run": f"fz-{seed}", "step": u, "trajectory_id": t,
                    "sample_index": i, "trainer_logprobs": -np.abs(rng.normal(size=n_resp)).astype(np.float32)}
            if rng.random() < 0.5:
                note["advantages"] = rng.normal(size=n_resp).astype(np.float32)
            if rng.random() < 0.3:
                note["entropy"] = np.abs(rng.normal(size=n_resp)).astype(np.float32)
            events.append(note)
        i = int(rng.integers(0, len(events)))
        events[i], name = mutate_lineage(events[i], rng, known)
        events = [ev if j == i else {k: _reencode(v, rng) for k, v in ev.items()} for j, ev in enumerate(events)]
        units.append((events, name))
    return units
