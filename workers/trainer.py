"""A trainer reader process: streams batches from a store and trains a tiny
megatron-core MoE model on them with Rollout Routing Replay, on the CPU.

    python workers/trainer.py --store sqlite:///trajstore-demo/trajstore.db --steps 5
    python workers/trainer.py --store URL --follow --timeout-s 60 --state reader.json   # async RL; resumable

Each step: read this rank's batch (``SampleReader``), collate it (packed by
default), turn its routes into router indices (``replay_indices``), run the
model with the routers forced to the recorded experts (``replay_routes``),
take a GRPO-style policy-gradient step, and report how many tokens the
routers sent to exactly the recorded experts (megatron's own routing map,
watched by a forward hook). ``--state`` saves the reader state after every
step and resumes from it on start.

The model is deliberately tiny (hidden 16; token ids folded into 1024
buckets) so it runs anywhere; the reader, collation and replay calls are
the ones a real Megatron trainer makes.

CPU: megatron-core 0.16.1 assumes CUDA and TransformerEngine in a few places
an MoE layer touches. ``cpu_world()`` patches exactly those for this process
(the same shims the test suite keeps in tests/megatron_cpu.py; they live in
runnable scripts and tests, never in the ``trajstore`` package, because on a
real trainer the GPU paths are the point).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from typing import Any, Iterator
from unittest import mock

import torch

HIDDEN_SIZE = 16
BUCKETS = 1024  # token ids are folded into this many embedding rows


@contextlib.contextmanager
def cpu_world() -> Iterator[None]:
    """CPU shims and a one-process model-parallel world for megatron-core 0.16.1."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        def patch(*args: Any, **kwargs: Any) -> None:
            stack.enter_context(mock.patch.object(*args, **kwargs))

        patch(torch.cuda, "current_device", lambda: torch.device("cpu"))  # parameters land on the CPU
        patch(moe_utils, "te_general_gemm", None, create=True)  # defined only with TransformerEngine
        patch(mcore_random, "_get_cuda_rng_state", lambda *a, **k: torch.empty(0))  # no CUDA RNG to save
        patch(mcore_random, "_set_cuda_rng_state", lambda *a, **k: None)
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1)
            stack.callback(dist.destroy_process_group)
        parallel_state.initialize_model_parallel(1, 1)
        stack.callback(parallel_state.destroy_model_parallel)
        yield


class TinyMoEModel(torch.nn.Module):
    """Embedding, residual megatron-core MoE layers (routing replay enabled), LM head."""

    def __init__(self, num_moe_layers: int, num_experts: int, topk: int) -> None:
        super().__init__()
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(
            num_layers=num_moe_layers, hidden_size=HIDDEN_SIZE, num_attention_heads=4,
            num_moe_experts=num_experts, moe_router_topk=topk, moe_ffn_hidden_size=32,
            moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
            moe_enable_routing_replay=True, moe_router_fusion=False, use_cpu_initialization=True,
            add_bias_linear=False)
        spec = get_moe_module_spec(use_te=False, num_experts=num_experts, moe_grouped_gemm=False)
        self.embedding = torch.nn.Embedding(BUCKETS, HIDDEN_SIZE)
        self.moe_layers = torch.nn.ModuleList(
            build_module(spec, config=config, layer_number=i + 1) for i in range(num_moe_layers))
        self.head = torch.nn.Linear(HIDDEN_SIZE, BUCKETS)

    def forward(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        """Logits [B, S, BUCKETS]; megatron layers run on [S, B, H]."""
        hidden_SBH = self.embedding(input_ids_BS % BUCKETS).transpose(0, 1).contiguous()
        for layer in self.moe_layers:
            hidden_SBH = hidden_SBH + layer(hidden_SBH)[0]
        return self.head(hidden_SBH).transpose(0, 1)


@contextlib.contextmanager
def router_agreement(model: TinyMoEModel, expected_TK: list[torch.Tensor], valid_T: torch.Tensor):
    """Count (token, layer) routings whose experts (megatron's routing map) equal ``expected_TK``."""
    counts = {"agree": 0, "total": 0}

    def check(expected: torch.Tensor, module: Any, args: Any, output: Any) -> None:
        chosen_TK = output[1].nonzero()[:, 1].view(expected.shape)  # ascending per token
        same_T = (chosen_TK == expected.sort(dim=-1).values).all(dim=-1)
        counts["agree"] += int(same_T[valid_T].sum())
        counts["total"] += int(valid_T.sum())

    hooks = [layer.router.register_forward_hook(lambda m, a, o, e=e: check(e, m, a, o))
             for layer, e in zip(model.moe_layers, expected_TK)]
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


def policy_loss(logits_BSV: torch.Tensor, batch: dict) -> torch.Tensor:
    """GRPO-style: -(advantage * log p(token)) over loss-masked response tokens;
    advantage = reward - mean reward of the sample's group in the batch."""
    rewards = torch.nan_to_num(batch["rewards"], nan=0.0)
    groups = batch["group_ids"]
    advantage_B = torch.stack([rewards[i] - rewards[[j for j, g in enumerate(groups) if g == groups[i]]].mean()
                               for i in range(len(groups))])
    # Positions are unshifted: the logits at s-1 predict the token at s.
    logp_BS = torch.log_softmax(logits_BSV[:, :-1].float(), -1).gather(
        -1, (batch["input_ids"][:, 1:] % BUCKETS)[..., None])[..., 0]
    mask_BS = batch["loss_mask"][:, 1:]
    advantage_BS = _per_token(advantage_B, batch)[:, 1:]
    return -(advantage_BS * logp_BS * mask_BS).sum() / mask_BS.sum().clamp(min=1.0)


def _per_token(values_B: torch.Tensor, batch: dict) -> torch.Tensor:
    """A per-sample value spread over the sample's positions ([B, S] or packed [1, T])."""
    if "cu_seqlens" in batch:
        lengths = batch["seq_lens"].long()
        out = torch.repeat_interleave(values_B, lengths)
        return torch.nn.functional.pad(out, (0, batch["input_ids"].shape[1] - out.numel()))[None]
    return values_B[:, None].expand(batch["input_ids"].shape)


def train_step(model: TinyMoEModel, optimizer: torch.optim.Optimizer, batch: dict, args: argparse.Namespace,
               moe_layer_ids: list[int]) -> dict[str, Any]:
    from trajstore.train.megatron import replay_indices, replay_routes

    packed = "cu_seqlens" in batch
    indices = replay_indices(
        batch["routed_experts"], batch["routed_experts_mask"], num_experts=args.num_experts,
        layout="packed" if packed else "padded", cu_seqlens=batch.get("cu_seqlens"),
        attention_mask_BS=None if packed else batch["attention_mask"], moe_layer_ids=moe_layer_ids)
    valid_T = (~batch["routed_experts_mask"] & batch["attention_mask"]).transpose(0, 1).reshape(-1)
    with torch.no_grad(), router_agreement(model, indices, valid_T) as free:
        model(batch["input_ids"])  # routing without replay, for contrast
    optimizer.zero_grad()
    with router_agreement(model, indices, valid_T) as replayed, replay_routes(model, indices, backward_recompute=False):
        loss = policy_loss(model(batch["input_ids"]), batch)
        loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {"loss": round(float(loss), 5), "grad_norm": round(float(grad_norm), 5),
            "replayed_tokens": replayed["total"] // len(indices), "replay_agreement": replayed["agree"] / max(1, replayed["total"]),
            "free_routing_agreement": free["agree"] / max(1, free["total"])}


def reader_config(args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {"follow": args.follow, "timeout_s": args.timeout_s,
                              "max_staleness": args.max_staleness, "num_shards": args.num_shards}
    if args.max_tokens:
        config["max_tokens_per_batch"] = args.max_tokens
    else:
        config["batch_size"] = args.batch_size
    if args.group_size:
        config.update(keep_groups=True, group_size=args.group_size)
    return config


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Train ``args.steps`` steps (or until the reader ends); one report per step, then a summary."""
    from trajstore.train.collate import collate
    from trajstore.reader import SampleReader

    reader = SampleReader(args.store, rank=args.rank, world_size=args.world_size, payload=args.payload,
                          current_model_version=args.start_version, **reader_config(args))
    if args.state and os.path.exists(args.state):
        with open(args.state) as f:
            reader.load_state_dict(json.load(f))
    model = optimizer = moe_layer_ids = None
    with reader, cpu_world():
        for step, samples in zip(range(args.steps), reader):
            if not samples:
                continue  # this rank's share of a final, partial step
            start = time.perf_counter()
            batch = collate(samples, layout=args.layout)
            if model is None:
                num_layers, topk = batch["routed_experts"].shape[2:]
                n = args.moe_layers  # spread over the recorded layers: first, ..., last
                moe_layer_ids = [round(i * (num_layers - 1) / max(1, n - 1)) for i in range(n)]
                torch.manual_seed(0)
                model = TinyMoEModel(len(moe_layer_ids), args.num_experts, topk)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            report = train_step(model, optimizer, batch, args, moe_layer_ids)
            report.update(step=reader.stats.steps, samples=len(samples), tokens=int(batch["seq_lens"].sum()),
                          stale_skipped=reader.stats.stale_samples, step_s=round(time.perf_counter() - start, 3),
                          routes=list(batch["routed_experts"].shape), moe_layer_ids=moe_layer_ids)
            if args.start_version is not None:  # the policy moves on as it trains
                reader.current_model_version = args.start_version + reader.stats.steps // args.version_every
            if args.state:
                _save(args.state, reader.state_dict())
            yield report
        state = json.dumps(reader.state_dict())
        yield {"summary": True, **reader.stats.to_dict(), "state_bytes": len(state)}


def _save(path: str, state: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)  # a crash mid-write keeps the previous state


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default=None, help="store URL (default $TRAJSTORE_URL)")
    p.add_argument("--payload", default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8, help="samples per batch")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per batch instead of --batch-size")
    p.add_argument("--group-size", type=int, default=None, help="keep GRPO groups of this many trajectories whole")
    p.add_argument("--layout", choices=["packed", "padded"], default="packed")
    p.add_argument("--num-experts", type=int, default=64, help="experts per MoE layer of the rollout model")
    p.add_argument("--moe-layers", type=int, default=2, help="MoE layers in the model (replay the first and last recorded)")
    p.add_argument("--start-version", type=int, default=None, help="trainer policy version at start (staleness)")
    p.add_argument("--version-every", type=int, default=1, help="steps per policy version")
    p.add_argument("--max-staleness", type=int, default=None)
    p.add_argument("--follow", action="store_true", help="keep polling for new samples")
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--num-shards", type=int, default=None,
                   help="materializer shards writing the store (default: as the store's checkpoints say)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--state", default=None, help="reader state file: resumed from, saved after each step")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for report in run(args):
        if args.json:
            print(json.dumps(report), flush=True)
        elif report.get("summary"):
            print(f"done: {report['steps']} steps, {report['samples']} samples, {report['tokens']} tokens; "
                  f"stale skipped {report['stale_samples']}; reader state {report['state_bytes']} bytes")
        else:
            print(f"step {report['step']}: {report['samples']} samples, {report['tokens']} tokens, "
                  f"loss {report['loss']:.4f}, replay agreement {report['replay_agreement']:.1%} "
                  f"(free routing {report['free_routing_agreement']:.1%})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
