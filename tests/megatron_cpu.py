"""Run real megatron-core MoE layers on a CPU-only machine, for tests.

megatron-core 0.16.1 assumes CUDA and TransformerEngine in a few places that
an MoE layer touches even with ``use_cpu_initialization=True``:

- the router and experts place parameters on ``torch.cuda.current_device()``;
  we point it at the CPU;
- ``moe_utils`` refers to ``te_general_gemm`` in the router's gating GEMM but
  only defines it when TransformerEngine imports; we define it as None so the
  plain ``torch.mm`` path runs;
- activation recompute (``tensor_parallel.checkpoint``) saves and restores
  the CUDA RNG state; we make those two calls no-ops;
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
    return TransformerConfig(
        num_layers=1,
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
