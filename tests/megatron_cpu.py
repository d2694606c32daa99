"""Run real megatron-core MoE layers on a CPU-only machine, for tests.

megatron-core 0.16.1 assumes CUDA and TransformerEngine in a few places that
an MoE layer touches even with ``use_cpu_initialization=True``:

- the router and experts place parameters on ``torch.cuda.current_device()``;
  we point it at the CPU;
- ``moe_utils`` refers to ``te_general_gemm`` in the router's gating GEMM but
  only defines it when TransformerEngine imports; we define it as None so the
  plain ``torch.mm`` path runs;
- activation recompute (``tensor_parallel.checkpoint``) saves and restores
  the CUDA RNG state; we make those two calls no-ops, and give the RNG
  tracker the model-parallel state that attention's dropout forks into;
- the layer reads its process groups from ``parallel_state``, so we start a
  one-process gloo group and a 1x1 model-parallel layout.

These shims live here, in tests, and never in ``trajstore.train.megatron``: on a
real trainer the GPU paths are the point.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist

HIDDEN_SIZE = 16
NUM_EXPERTS = 8
TOPK = 2


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Install the CPU shims and a single-process model-parallel world; undo both on exit."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:

        def patch(*args, **kwargs) -> None:
            stack.enter_context(mock.patch.object(*args, **kwargs))

        patch(torch.cuda, "current_device", lambda: torch.device("cpu"))
        patch(moe_utils, "te_general_gemm", None, create=True)
        # Activation recompute saves and restores the CUDA RNG; there is none.
        patch(mcore_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.empty(0))
        patch(mcore_random, "_set_cuda_rng_state", lambda *args, **kwargs: None)
        # Attention forks this state around its dropout; with the two calls above
        # a fork is a no-op on the CPU.
        tracker = mcore_random.get_cuda_rng_tracker()
        stack.enter_context(mock.patch.dict(tracker.states_, {"model-parallel-rng": torch.empty(0)}))
        if not dist.is_initialized():
            # A file store needs no free port, so parallel test runs cannot collide.
            store = f"file://{os.path.join(tmp, 'store')}"
            dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
            stack.callback(dist.destroy_process_group)
        parallel_state.initialize_model_parallel(1, 1)
        stack.callback(parallel_state.destroy_model_parallel)
        yield


def moe_config(*, routing_replay: bool = True, recompute: bool = False, **overrides):
    """A tiny TransformerConfig for one MoE layer (hidden 16, 8 experts, top-2, allgather)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute_kwargs = (
        {"recompute_granularity": "selective", "recompute_modules": ["moe"]} if recompute else {}
    )
    overrides.setdefault("num_layers", 1)
    return TransformerConfig(
        hidden_size=HIDDEN_SIZE,
        num_attention_heads=4,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=32,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        moe_enable_routing_replay=routing_replay,
        use_cpu_initialization=True,
        add_bias_linear=False,
        **recompute_kwargs,
        **overrides,
    )


def build_moe_layer(*, seed: int = 0, **config_kwargs):
    """A real megatron-core MoELayer (local, non-TE modules) in training mode on the CPU.

    Must run inside ``cpu_megatron()``. Each call registers one more
    ``RouterReplay`` instance in megatron's global list when replay is enabled.
    """
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    torch.manual_seed(seed)
    spec = get_moe_module_spec(use_te=False, num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    layer = build_module(spec, config=moe_config(**config_kwargs), layer_number=1)
    return layer.train()


class MoEStack(torch.nn.Module):
    """Residual stack of real MoE layers with a dense layer between each pair.

    The dense layers have no router, standing in for a model whose recorded
    routes cover only its MoE layers. Hidden states are [S, B, H], as in
    megatron.
    """

    def __init__(self, num_moe_layers: int, *, seed: int = 0, **config_kwargs) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for i in range(num_moe_layers):
            if i:
                layers.append(torch.nn.Linear(HIDDEN_SIZE, HIDDEN_SIZE))
            layers.append(build_moe_layer(seed=seed + i, **config_kwargs))
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, hidden_SBH: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            out = layer(hidden_SBH)
            hidden_SBH = hidden_SBH + (out[0] if isinstance(out, tuple) else out)
        return hidden_SBH


def build_block(moe_layer_freq, *, num_layers: int, seed: int = 0, **overrides):
    """A real megatron-core TransformerBlock (local specs) with dense and MoE layers.

    ``moe_layer_freq`` is megatron's own setting: an int N (an MoE layer at every
    i % N == 0) or a list of 0 (dense) / 1 (MoE) per layer. Layers carry megatron's
    global ``layer_number`` (1-based), as in a GPTModel's decoder. Must run inside
    ``cpu_megatron()``. Forward with ``block(hidden_SBH, attention_mask=causal_mask(S))``.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = moe_config(num_layers=num_layers, moe_layer_freq=moe_layer_freq, ffn_hidden_size=32,
                        attention_dropout=0.0, hidden_dropout=0.0, **overrides)
    torch.manual_seed(seed)
    block = TransformerBlock(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False))
    return block.train()


def causal_mask(seq_len: int) -> torch.Tensor:
    """megatron's attention mask (True = masked), built on the CPU: its default is made on CUDA."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
