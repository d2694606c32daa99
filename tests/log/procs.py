"""Processes the log tests start (module-level so ``spawn`` can import them)."""

from __future__ import annotations

import os
import sys

from trajstore.demo._simulate import RolloutConfig, trajectory_events

# Big events so a SIGKILL lands inside payload writes and transactions.
HEAVY = RolloutConfig(turns=2, prompt_tokens=1500, output_tokens=500, observation_tokens=100,
                      layers=48, topk=8, num_experts=128, abort_prob=0.0, seed=7)


def small_trajectory(writer: int, k: int) -> list[dict]:
    tid = f"w{writer}-t{k}"
    evs = [{"type": "trajectory_started", "trajectory_id": tid, "group_id": f"w{writer}"}]
    prompt = [1, 2, 3]
    for seq in range(8):
        out = [seq + 10, seq + 11]
        evs.append({"type": "generation", "trajectory_id": tid, "seq": seq, "prompt_ids": prompt,
                    "output_ids": out, "model_version": seq, "logprobs": [-0.5, -0.25]})
        prompt = prompt + out + [7]
    evs.append({"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"})
    return evs


def concurrent_writer(url: str, payload: str, writer: int, num_trajectories: int) -> None:
    """Appends num_trajectories x 10 events, two at a time (many small interleaved transactions)."""
    from trajstore.store import connect

    store = connect(url, payload=payload)
    for k in range(num_trajectories):
        evs = small_trajectory(writer, k)
        for i in range(0, len(evs), 2):
            store.append(evs[i : i + 2])
    store.close()


def acking_writer(url: str, payload: str, ack_path: str, start: int) -> None:
    """Appends one heavy trajectory per call; records each acknowledged index durably."""
    from trajstore.store import connect

    store = connect(url, payload=payload)
    with open(ack_path, "a") as ack:
        i = start
        while True:
            store.append(trajectory_events(HEAVY, i))
            ack.write(f"{i}\n")
            ack.flush()
            os.fsync(ack.fileno())
            i += 1


if __name__ == "__main__":
    acking_writer(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))


def aggregate_writer(url: str, payload: str, first: int, count: int) -> None:
    """Appends the report tests' run trajectories ``first .. first + count``, one event per
    append (every append counts its own run aggregates: many concurrent small transactions
    on the same aggregate keys)."""
    from tests.inspect.test_report import run_events
    from trajstore.store import connect

    store = connect(url, payload=payload)
    for evs in run_events(first, count):
        for e in evs:
            store.append([e])
    store.close()
