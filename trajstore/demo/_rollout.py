"""A token-level agent for ``trajstore.rollout``: episodes that continue from a tail after a crash.

``TokenAgent`` is an episode function: a multi-turn agent on the simulated
engine's token-in/token-out endpoint (``POST /inference/v1/generate``,
through the recording proxy). Every turn's prompt is the previous prompt +
answer + a tool observation, so a running trajectory is continued exactly
from the plan's ``Tail``: the next call's prompt is ``tail.tokens`` + the
observation of turn ``tail.next_seq`` (none after an ``abort``: the answer
goes on). The answers are a pure function of the prompt and the member's
sampling seed, the rewards and failures of the tokens and trajectory id, so a
run killed any number of times ends with the same samples as one that was
not (the per-token weight versions aside).

``python -m trajstore.demo._rollout --store URL --proxy URL ...`` runs a
``RolloutDriver`` with it over a synthetic dataset (the kill -9 tests'
driver process).
"""

from __future__ import annotations

import argparse
import logging
import sys
import zlib
from typing import Any

from trajstore.demo._engine import ASSISTANT, END, TOOL, USER, encode
from trajstore.errors import TrajstoreError
from trajstore.rollout import Episode, Outcome, RolloutDriver

__all__: list[str] = []


def prompt_tokens(prompt_id: str) -> list[int]:
    return [USER, *encode(f"Solve {prompt_id}."), END, ASSISTANT]


def observation(turn: int) -> list[int]:
    return [TOOL, *encode(f"result {turn}"), END, ASSISTANT]


def member_seed(prompt_id: str, epoch: int, index: int) -> int:
    """The sampling seed of a group's ``index``-th member: another run of the same dataset samples alike."""
    return zlib.crc32(f"{prompt_id}/{epoch}/{index}".encode()) % 100_000


class TokenAgent:
    """``turns`` engine calls per episode through ``proxy``. With ``fail_every=k`` the members
    whose seed is a multiple of k fail (a harness error), so groups get replacements. With
    ``ack_log`` every call the proxy acknowledged is written there (``trajectory_id seq``) before
    the episode goes on: what must be in the store whatever happens next."""

    def __init__(self, client: Any, proxy: str, *, turns: int = 3, max_tokens: int = 6, fail_every: int = 0,
                 ack_log: str | None = None) -> None:
        self.client, self.proxy, self.turns, self.max_tokens = client, proxy.rstrip("/"), turns, max_tokens
        self.fail_every, self.ack_log = fail_every, ack_log

    def __call__(self, ep: Episode) -> Outcome:
        tail = ep.tail
        turn = tail.next_seq if tail is not None else 0
        tokens = [int(t) for t in tail.tokens] if tail is not None and len(tail.tokens) else []
        if not tokens:
            turn, prompt = 0, prompt_tokens(ep.prompt_id)
        elif tail.last_finish_reason == "abort":
            prompt = tokens  # an answer cut off: the next call goes on with it
        else:
            prompt = tokens + observation(turn)
        headers = {"X-Trajstore-Trajectory": ep.trajectory_id, "X-Trajstore-Model-Version": "0"}
        seed = member_seed(ep.prompt_id, ep.epoch, ep.index)
        while turn < self.turns:
            r = self.client.post(f"{self.proxy}/inference/v1/generate", headers=headers, json={
                "model": "simulated", "token_ids": prompt, "sampling_params": {"max_tokens": self.max_tokens,
                                                                             "seed": seed}})
            if r.status_code != 200:
                raise TrajstoreError(f"{ep.trajectory_id} turn {turn}: {r.status_code} "
                                     f"{r.headers.get('x-trajstore-error') or r.text[:200]}")
            if self.ack_log is not None:
                with open(self.ack_log, "a") as f:
                    f.write(f"{ep.trajectory_id} {r.headers.get('x-trajstore-seq')}\n")
            tokens = prompt + list(r.json()["choices"][0]["token_ids"])
            turn += 1
            prompt = tokens + observation(turn)
        if self.fail_every and seed % self.fail_every == 0:
            return Outcome("failed", 0.0)
        return Outcome("completed", float(sum(tokens) % 2))


def main(argv: list[str] | None = None) -> int:
    import httpx

    from trajstore.store import connect

    p = argparse.ArgumentParser(prog="python -m trajstore.demo._rollout")
    p.add_argument("--store", required=True)
    p.add_argument("--proxy", required=True)
    p.add_argument("--run", default="rollout")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--skip", default="", help="comma-separated prompt ids to skip for good")
    p.add_argument("--ack-log", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s driver %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    skip = set(filter(None, args.skip.split(",")))
    dataset = [(f"p{i:03d}", None) for i in range(args.prompts)]
    with connect(args.store, migrate=False) as store, httpx.Client(timeout=30) as client:
        driver = RolloutDriver(
            store, args.run, dataset, episode=TokenAgent(client, args.proxy, turns=args.turns, fail_every=args.fail_every,
                                                     ack_log=args.ack_log),
            group_size=args.group_size, epochs=args.epochs, seed=args.seed, concurrency=args.concurrency,
            skip=lambda prompt_id, item: "listed in --skip" if prompt_id in skip else None,
            started={"num_experts": 16}, retry_for_s=60)
        stats = driver.run()
    print(f"done {stats}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
