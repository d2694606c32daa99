"""A synthetic rollout worker: multi-turn MoE trajectories through a Writer.

Stands in for an agent harness on a rollout node (load tests, demos):

    python workers/rollout.py --sink http://ingest:8700 --worker-id 3 --trajectories 100   # $TRAJSTORE_TOKEN
    python workers/rollout.py --sink sqlite:///store.db                                     # in-process store

Each trajectory has ``--turns`` engine calls; every call's prompt is the
previous prompt + output + a short observation, so the calls merge into one
sample per trajectory, with routes ``[prompt + output - 1, layers, topk]``
like vLLM returns. A real harness replaces ``fake_engine_call`` with its
engine call and passes the result to ``traj.from_vllm(...)``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from trajstore.ingest.client import Writer


def fake_engine_call(rng: np.random.Generator, prompt: np.ndarray, args: argparse.Namespace) -> dict:
    """What an engine returns for ``prompt``: output ids, their logprobs, route rows."""
    output = rng.integers(0, args.vocab, args.output_tokens, dtype=np.int32)
    rows = len(prompt) + len(output) - 1
    return {
        "output_ids": output,
        "logprobs": -rng.random(len(output), dtype=np.float32),
        "routed_experts": rng.integers(0, args.num_experts, (rows, args.layers, args.topk), dtype=np.uint8),
    }


def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.worker_id)
    num_tokens = 0
    start = time.perf_counter()
    with Writer(args.sink, token=args.token, max_batch_events=args.max_batch_events) as writer:
        for i in range(args.trajectories):
            tid = f"w{args.worker_id}-t{i}"
            with writer.trajectory(tid, group_id=f"w{args.worker_id}-g{i // args.group_size}",
                                   num_experts=args.num_experts) as traj:
                prompt = rng.integers(0, args.vocab, args.prompt_tokens, dtype=np.int32)
                for _ in range(args.turns):
                    call = fake_engine_call(rng, prompt, args)
                    traj.generation(prompt, model_version=args.model_version, **call)
                    num_tokens += len(prompt) + len(call["output_ids"])
                    observation = rng.integers(0, args.vocab, args.observation_tokens, dtype=np.int32)
                    prompt = np.concatenate([prompt, call["output_ids"], observation])
                traj.finish("completed", reward=float(rng.random()))
        writer.flush()
    elapsed_s = time.perf_counter() - start
    num_events = args.trajectories * (args.turns + 3)
    return {"events": num_events, "tokens": num_tokens, "elapsed_s": elapsed_s, "events_per_s": num_events / elapsed_s}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="synthetic rollout worker writing through trajstore.ingest.client.Writer")
    p.add_argument("--sink", default=None, help="http(s)://host:port of the ingest service, or a store URL")
    p.add_argument("--token", default=None, help="bearer token (default $TRAJSTORE_TOKEN)")
    p.add_argument("--worker-id", type=int, default=0)
    p.add_argument("--trajectories", type=int, default=10)
    p.add_argument("--group-size", type=int, default=4, help="trajectories per GRPO group")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--observation-tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=128)
    p.add_argument("--vocab", type=int, default=150_000)
    p.add_argument("--model-version", type=int, default=0)
    p.add_argument("--max-batch-events", "--batch-size", type=int, default=64, dest="max_batch_events",
                   help="events per request (--batch-size: its old name)")
    stats = run(p.parse_args(argv))
    print(f"{stats['events']} events, {stats['tokens']} tokens in {stats['elapsed_s']:.2f} s "
          f"({stats['events_per_s']:.1f} events/s)")


if __name__ == "__main__":
    main()
