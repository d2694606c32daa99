"""``trajstore demo --engine``: an agent episode through the recording proxy, on CPU, in seconds.

Starts the simulated engine (``trajstore.demo._engine``, vLLM 0.33's wire
shapes) and a real ``trajstore proxy`` app in front of it on loopback, runs a
few multi-turn agent episodes through the proxy with plain HTTP (an OpenAI
client would send the same requests) under ``trajstore.rollout``'s driver
(two prompts, a group of two episodes each, recorded in the rollout ledger),
folds them and prints what was recorded: each
call's tokens, version spans and route rows, and the merged sample a trainer
reads. ``--engine-only`` serves the engine alone for the step-by-step
version (docs/first-hour.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import threading
import time
from typing import Any, Iterator

from trajstore.errors import TrajstoreError
from trajstore.rollout import Episode, Outcome, RolloutDriver

__all__: list[str] = []

EPISODES = 4
TURNS = 3
TOOL_OUTPUTS = ("ls: main.py tests/", "tests: 3 passed", "done")


@contextlib.contextmanager
def _serving(app: Any, name: str) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=60))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"demo-{name}")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise TrajstoreError(f"demo: the {name} did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def run_episode(client: Any, proxy: str, trajectory_id: str, *, group_id: str, turns: int = TURNS,
                reward: float = 1.0, finish: bool = True) -> list[dict]:
    """One agent episode through the proxy: a chat whose every turn adds the model's answer
    and a tool's output, then (``finish``) ``/trajstore/finish``. Returns the responses."""
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"Fix the failing test ({trajectory_id})."}]
    headers = {"X-Trajstore-Trajectory": trajectory_id, "X-Trajstore-Group": group_id,
               "X-Trajstore-Num-Experts": "16", "X-Trajstore-Model-Version": "0"}
    responses = []
    for turn in range(turns):
        r = client.post(f"{proxy}/v1/chat/completions", headers=headers,
                        json={"model": "simulated", "messages": messages, "max_tokens": 6})
        if r.status_code != 200 or "x-trajstore-error" in r.headers:
            raise TrajstoreError(f"demo: the proxy did not record turn {turn} of {trajectory_id}: "
                                 f"{r.status_code} {r.headers.get('x-trajstore-error') or r.text[:200]}")
        body = r.json()
        responses.append(body)
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        messages.append({"role": "tool", "content": TOOL_OUTPUTS[turn % len(TOOL_OUTPUTS)]})
    if not finish:
        return responses
    r = client.post(f"{proxy}/trajstore/finish", json={"trajectory_id": trajectory_id, "status": "completed",
                                                        "reward": reward})
    if r.status_code != 200:
        raise TrajstoreError(f"demo: finishing {trajectory_id} failed: {r.status_code} {r.text[:200]}")
    return responses


class DemoDriver(RolloutDriver):
    """The demo's rollout: two prompts ("tasks"), a group of two chat episodes each (``episode-0`` ..
    ``episode-3``), one episode at a time (the engine's weight clock is engine-wide)."""

    def __init__(self, store: Any, client: Any, proxy: str) -> None:
        def episode(ep: Episode) -> Outcome:
            run_episode(client, proxy, ep.trajectory_id, group_id=ep.group_id, finish=False)
            return Outcome("completed", float(int(ep.trajectory_id.split("-")[1]) % 2))

        super().__init__(store, "demo", [(f"task-{k}", None) for k in range(EPISODES // 2)], episode=episode,
                         group_size=2, shuffle=False, concurrency=1, resume="replace",
                         started={"num_experts": 16}, retry_for_s=0)

    def group_id(self, prompt_id: str, epoch: int) -> str:
        return prompt_id

    def trajectory_id(self, group_id: str, index: int) -> str:
        return f"episode-{int(group_id.split('-')[1]) * 2 + index}"


def _show(console: Any, store: Any, trajectory_id: str) -> None:
    from rich.table import Table

    from trajstore.inspect.sql import read_only

    with read_only(store.url) as query:
        rows = query("SELECT trajectory_id, seq, prompt_len, output_len, sample_index, is_merged, weight_versions, "
                     "num_route_rows_sent, num_route_rows_stored, route_rows_drifted FROM generation_events "
                     "ORDER BY trajectory_id, seq").rows
    calls = [row[1:] for row in rows if row[0] == trajectory_id]
    table = Table(title=f"calls recorded for {trajectory_id} (SQL view generation_events)")
    for column in ("seq", "prompt", "output", "sample", "merged", "weight-version spans", "routes sent",
                   "routes kept", "drifted"):
        table.add_column(column)
    for row in calls:
        table.add_row(*("" if v is None else str(v) for v in row))
    console.print(table)
    (sample,) = [s for s in store.samples() if s.trajectory_id == trajectory_id]
    console.print(f"sample {trajectory_id}#{sample.sample_index}: prompt {len(sample.prompt_ids)} tokens, "
                  f"response {len(sample.response_ids)} tokens")
    console.print(f"  loss_mask            {sample.loss_mask.tolist()}")
    console.print(f"  token_model_versions {sample.token_model_versions.tolist()}")
    console.print(f"  routed_experts       {sample.routed_experts.dtype}{list(sample.routed_experts.shape)} "
                  f"(positions without a route: {int(sample.routed_experts_mask.sum())})")


def run_engine_demo(args: argparse.Namespace) -> int:
    """``trajstore demo --engine``: episodes through engine + proxy into a fresh store in ``--dir``."""
    import httpx
    from rich.console import Console

    from trajstore.demo._engine import make_engine
    from trajstore.ingest.proxy import make_proxy_app
    from trajstore.store import connect

    console = Console(width=None if __import__("sys").stdout.isatty() else 160)
    url = args.store
    if url is None:  # a directory of its own by default, and only its own files: `demo`'s store stays
        from trajstore.demo._run import _ENGINE_MADE, ENGINE_DB, ENGINE_DIR, _prepare_dir

        args.dir = args.dir or ENGINE_DIR
        _prepare_dir(args.dir, _ENGINE_MADE)
        url = f"sqlite:///{os.path.abspath(os.path.join(args.dir, ENGINE_DB))}"
    store = connect(url, payload=args.payload)
    try:
        if sum(store.info()["trajectories_by_status"].values()):
            raise TrajstoreError(f"{store!r} already holds trajectories; the demo needs an empty store "
                                 "(omit --store to use a fresh one in --dir)")
        started = time.monotonic()
        # The engine publishes new weights every 10 tokens it generates: calls span two versions.
        engine = make_engine(weight_update_every=10)
        with _serving(engine, "simulated engine") as upstream, \
                _serving(make_proxy_app(store, upstream), "proxy") as proxy, \
                httpx.Client(timeout=30) as client:
            console.print(f"[bold]trajstore demo --engine[/bold]: simulated vLLM at {upstream}, "
                          f"trajstore proxy at {proxy}, store {store!r}")
            DemoDriver(store, client, proxy).run()
        stats = store.materialize()
        console.print(f"recorded {EPISODES} episodes x {TURNS} calls; folded {stats.num_samples_after} samples "
                      f"(merge ratio {stats.merge_ratio:.2f}) in {time.monotonic() - started:.1f} s")
        plan = store.rollout_state("demo")
        console.print(f"rollout ledger of run demo: {len(plan.dispatched)} prompts dispatched, {len(plan.whole)} "
                      f"groups whole, {len(plan.open)} open (store.rollout_state; docs/rollout.md)")
        _show(console, store, "episode-0")
    finally:
        store.close()
    print(f"\nNext: trajstore --store {url} sql \"SELECT trajectory_id, seq, weight_versions FROM generation_events\"\n"
          "Step by step with your own harness: docs/first-hour.md", flush=True)
    return 0


def serve_engine(args: argparse.Namespace) -> int:
    """``trajstore demo --engine-only``: the simulated engine alone until Ctrl-C."""
    from trajstore.demo._engine import make_engine
    from trajstore.ingest._http import run_server

    run_server(make_engine(weight_update_every=args.weight_update_every), name="simulated engine",
               host=args.host, port=args.port)
    return 0
