"""One SGLang call vs the same vLLM call: adapter time and append time (docs/sglang.md "Numbers").

A call of a Qwen3-30B-A3B-sized MoE (48 layers, top-8 of 128 experts):
prompt P, output O tokens, every route row returned. SGLang sends the routes
as base64 raw int32 (`meta_info["routed_experts"]`), vLLM as a base64 int32
`.npy`. Measured per call, median of --repeat runs, on an embedded store in
a temporary directory:

* adapter: response dict (already parsed JSON) -> generation event;
* append: ``store.append`` of trajectory_started + the event (a fresh trajectory per run).

Run: PYTHONPATH=. python bench/bench_sglang.py [--prompt 4096 --output 1024 --repeat 15]
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trajstore  # noqa: E402
from trajstore.events._wire import encode_npy_b64  # noqa: E402
from trajstore.ingest.sglang import generation_from_generate  # noqa: E402
from trajstore.ingest.vllm import generations_from_tito  # noqa: E402

LAYERS, TOPK, EXPERTS = 48, 8, 128


def responses(prompt_len: int, output_len: int) -> tuple[dict, dict, dict, dict]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 150_000, prompt_len).tolist()
    out = rng.integers(0, 150_000, output_len).tolist()
    lps = (-rng.random(output_len)).tolist()
    routes = rng.integers(0, EXPERTS, (prompt_len + output_len - 1, LAYERS, TOPK), dtype=np.int32)
    s_req = {"input_ids": prompt, "return_logprob": True, "return_routed_experts": True}
    s_resp = {"text": "", "output_ids": out, "meta_info": {
        "id": "x", "finish_reason": {"type": "length", "length": output_len}, "prompt_tokens": prompt_len,
        "weight_version": "default", "completion_tokens": output_len,
        "weight_versions": [{"version": "default", "start": 0, "end": output_len}],
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out)],
        "routed_experts": base64.b64encode(routes.tobytes()).decode()}}
    v_req = {"token_ids": prompt, "sampling_params": {"logprobs": 0}}
    v_resp = {"choices": [{"index": 0, "token_ids": out, "finish_reason": "length",
                           "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}
                                                    for t, lp in zip(out, lps)]},
                           "routed_experts": encode_npy_b64(routes)}]}
    return s_req, s_resp, v_req, v_resp


def median_ms(fn, repeat: int) -> float:
    times = []
    for i in range(repeat):
        t = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--output", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    s_req, s_resp, v_req, v_resp = responses(args.prompt, args.output)
    layout = (LAYERS, TOPK)

    def sglang_event(i: int) -> dict:
        return generation_from_generate(s_resp, s_req, trajectory_id=f"s{i}", seq=0, model_version=3,
                                        route_layout=layout)

    def vllm_event(i: int) -> dict:
        return generations_from_tito(v_resp, v_req, trajectory_id=f"v{i}", seq=0, model_version=3)[0]

    rows = args.prompt + args.output - 1
    print(f"call: prompt {args.prompt}, output {args.output}, routes [{rows}, {LAYERS}, {TOPK}] int32 "
          f"({rows * LAYERS * TOPK * 4 / 2**20:.1f} MiB raw), median of {args.repeat}")
    print(f"adapter   sglang {median_ms(sglang_event, args.repeat):8.2f} ms   vllm {median_ms(vllm_event, args.repeat):8.2f} ms")
    with tempfile.TemporaryDirectory() as tmp:
        store = trajstore.connect(f"sqlite:///{tmp}/b.db")
        try:
            def append(make):
                def run(i: int) -> None:
                    event = make(i)
                    store.append([{"type": "trajectory_started", "trajectory_id": event["trajectory_id"],
                                   "num_experts": EXPERTS}, event])
                return run
            s_ms = median_ms(append(sglang_event), args.repeat)
            v_ms = median_ms(append(vllm_event), args.repeat)
        finally:
            store.close()
    print(f"adapter + append   sglang {s_ms:8.2f} ms   vllm {v_ms:8.2f} ms")


if __name__ == "__main__":
    main()
