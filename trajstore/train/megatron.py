"""Rollout Routing Replay (R3) for megatron-core MoE trainers.

The engine that sampled a trajectory recorded which experts each token was
routed to; replaying those routes in the trainer makes the trained policy use
the same experts the sampling policy used. This module turns the reader's
collated routes into what megatron-core's router consumes, and forces the
routers to use them for one training step.

Enable replay in the model config (megatron-core 0.16.1), or the routers have
nothing to replay into::

    TransformerConfig(..., moe_enable_routing_replay=True, moe_router_fusion=False)

``moe_enable_routing_replay`` gives every ``TopKRouter`` a ``RouterReplay``
(``router.router_replay``). The fused TransformerEngine top-k
(``moe_router_fusion=True``) and sinkhorn routing never consult it, so
``replay_routes`` refuses them instead of silently routing freely. Token
dropping (``moe_expert_capacity_factor``) is applied after the replayed top-k
and may still drop replayed assignments.

Typical step::

    indices = replay_indices(batch["routed_experts"], batch["routed_experts_mask"],
                             attention_mask_BS=batch["attention_mask"], num_experts=64)
    with replay_routes(model, indices) as replay:
        loss = loss_fn(model(...))
        replay.backward_phase()   # activation recompute must replay, not re-route
        loss.backward()

For several microbatches, call ``replay.next_microbatch(indices)`` before each
further forward and ``replay.backward_phase()`` after each forward; recompute
consumes the microbatches first in, first out, which is the order megatron's
pipeline schedules run backward in.

Dense layers. The engine records one ``[topk]`` entry per hidden layer of
the model, dense layers included (vLLM fills them with zeros), while megatron
builds a router only in its MoE layers. Pass the model's ``TransformerConfig``
and the recorded layers are matched to the MoE layers megatron builds
(``moe_layer_freq``: an int N puts an MoE layer at every layer i with
i % N == 0; a list such as ``[0]*3 + [1]*58`` for DeepSeek-style
first-k-dense marks them one by one), and each router replays its own layer,
found by the global ``layer_number`` megatron gives it (so a pipeline stage
replays the layers it holds)::

    indices = replay_indices(batch["routed_experts"], batch["routed_experts_mask"],
                             attention_mask_BS=batch["attention_mask"], config=model.config)
    with replay_routes(model, indices) as replay:
        ...

Under sequence or context parallelism, slice ``routes_BSLK`` and ``mask_BS``
along S exactly as the rank's tokens are sliced before calling
``replay_indices``: the router's token order is s-major, so a slice of S is a
contiguous run of router rows.

Shape suffixes:
    B  batch rows (1 in the packed layout)
    S  positions per row (the packed length T in the packed layout)
    L  recorded layers (with ``config``: every hidden layer, as the engine records them)
    K  top-k experts per token
    T  tokens as the router sees them: S*B, s-major (t = s*B + b)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from trajstore.errors import ValidationError

__all__ = ["RouteReplay", "moe_layer_ids", "replay_indices", "replay_routes"]

_RULE = "router_replay"


def moe_layer_ids(config: Any) -> list[int]:
    """The 0-based indexes of the MoE layers a megatron-core ``TransformerConfig`` builds.

    Read as megatron-core 0.16.1 reads it to pick each layer's spec
    (``models/gpt/gpt_layer_specs.py``, ``get_gpt_decoder_layer_specs``):
    ``moe_layer_freq`` an int N makes layer i an MoE layer when i % N == 0,
    a list of ``num_layers`` 0/1 entries marks each layer (1 = MoE);
    first-k-dense models (DeepSeek-V3's ``first_k_dense_replace``) are the
    list ``[0]*k + [1]*(num_layers-k)``. These are also the recorded layers
    to replay: engines record every hidden layer in order.
    """
    num_layers = getattr(config, "num_layers", None)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise _error(f"config.num_layers must be a positive integer, got {num_layers!r}")
    if not getattr(config, "num_moe_experts", None):
        raise _error("config has no MoE layers (num_moe_experts is not set): nothing to replay")
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise _error(f"config.moe_layer_freq must be >= 1, got {freq}")
        return [i for i in range(num_layers) if i % freq == 0]
    if isinstance(freq, (list, tuple)):
        if len(freq) != num_layers or any(p not in (0, 1) for p in freq):
            raise _error(
                f"config.moe_layer_freq must list {num_layers} entries of 0 (dense) or 1 (MoE), "
                f"got {list(freq)}"
            )
        return [i for i, p in enumerate(freq) if p == 1]
    raise _error(f"config.moe_layer_freq must be an int or a list, got {freq!r}")


def replay_indices(
    routes_BSLK: Any,
    mask_BS: Any,
    *,
    num_experts: int | None = None,
    attention_mask_BS: Any = None,
    layout: Literal["padded", "packed"] = "padded",
    cu_seqlens: Any = None,
    moe_layer_ids: Sequence[int] | None = None,
    config: Any = None,
) -> Any:
    """The int64 ``[T, K]`` expert ids per MoE layer, in the router's token order.

    ``routes_BSLK`` (uint8/uint16/int16, torch or numpy) and ``mask_BS``
    (True = no captured route) come from the reader. ``layout="padded"``
    takes an ``attention_mask_BS`` (False = padding, left or right);
    ``"packed"`` takes one row ``[1, T]`` and optionally ``cu_seqlens``
    [n+1], past whose end the row is padding.

    With ``config`` (the model's megatron ``TransformerConfig``): the routes
    must record one entry per layer of the model (``config.num_layers``, as
    vLLM records them, dense layers included) and the result is a dict from
    each MoE layer's 0-based index (``moe_layer_ids(config)``) to its
    indices; ``num_experts`` defaults to ``config.num_moe_experts``.
    ``replay_routes`` gives each router the entry of its own layer.

    Without it: a list, entry i for local MoE layer i, replaying recorded
    layer ``moe_layer_ids[i]`` (default: every recorded layer, in order).

    Masked and padding rows get experts 0..K-1: distinct, as the router's
    scatter into a routing map needs, and ignored by the loss anyway. Recorded
    rows must already be distinct ids below ``num_experts``.
    """
    routes_BSLK = torch.as_tensor(routes_BSLK)
    invalid_BS = _invalid_rows(routes_BSLK, mask_BS, attention_mask_BS, layout, cu_seqlens)
    invalid_BS = invalid_BS.to(routes_BSLK.device)
    layer_ids: list[int] | None = None
    if config is not None:
        layer_ids = _config_layers(config, routes_BSLK.shape[2], moe_layer_ids)
        moe_layer_ids = layer_ids
        num_experts = _config_experts(config, num_experts)
    elif num_experts is None:
        raise _error("num_experts is required (or pass config, the model's TransformerConfig)")
    routes_BSLK = _select_layers(routes_BSLK, moe_layer_ids).long()
    _check_experts(routes_BSLK, invalid_BS, num_experts)
    num_rows, seq_len, num_layers, topk = routes_BSLK.shape
    filler_K = torch.arange(topk, dtype=torch.long, device=routes_BSLK.device)
    routes_BSLK = torch.where(invalid_BS[:, :, None, None], filler_K, routes_BSLK)
    # megatron runs [S, B, H] hidden states and the router flattens them, so
    # router row t is position s of batch row b with t = s*B + b.
    routes_TLK = routes_BSLK.transpose(0, 1).reshape(seq_len * num_rows, num_layers, topk)
    per_layer = [routes_TLK[:, layer].contiguous() for layer in range(num_layers)]
    if layer_ids is not None:
        return dict(zip(layer_ids, per_layer))
    return per_layer


def _config_layers(config: Any, num_recorded: int, explicit_ids: Sequence[int] | None) -> list[int]:
    """The recorded layers to replay for ``config``, after checking the routes fit the model."""
    if explicit_ids is not None:
        raise _error("pass config or moe_layer_ids, not both: config derives the MoE layers")
    layer_ids = moe_layer_ids(config)
    if num_recorded != config.num_layers:
        raise _error(
            f"routes record {num_recorded} layers but the model has num_layers={config.num_layers}: "
            "replay needs one recorded entry per hidden layer of this model (as vLLM records them, "
            "dense layers included); were these routes sampled from another model?"
        )
    return layer_ids


def _config_experts(config: Any, num_experts: int | None) -> int:
    if num_experts is not None and num_experts != config.num_moe_experts:
        raise _error(
            f"num_experts={num_experts} disagrees with config.num_moe_experts={config.num_moe_experts}"
        )
    return int(config.num_moe_experts)


def _invalid_rows(
    routes_BSLK: torch.Tensor, mask_BS: Any, attention_mask_BS: Any, layout: str, cu_seqlens: Any
) -> torch.Tensor:
    """Rows that carry no route to replay: masked, padding, or past the packed sequences."""
    if routes_BSLK.dim() != 4:
        raise _error(f"routes_BSLK must be [B, S, L, K], got shape {tuple(routes_BSLK.shape)}")
    if layout not in ("padded", "packed"):
        raise _error(f"layout must be 'padded' or 'packed', got {layout!r}")
    shape_BS = tuple(routes_BSLK.shape[:2])
    invalid_BS = _bool_BS(mask_BS, shape_BS, "mask_BS")
    if attention_mask_BS is not None:
        invalid_BS = invalid_BS | ~_bool_BS(attention_mask_BS, shape_BS, "attention_mask_BS")
    if layout == "packed":
        if shape_BS[0] != 1:
            raise _error(f"packed layout needs one row [1, T], got B={shape_BS[0]}")
        if cu_seqlens is not None:
            invalid_BS = invalid_BS.clone()
            invalid_BS[0, _packed_end(cu_seqlens, shape_BS[1]) :] = True
    elif cu_seqlens is not None:
        raise _error(
            "cu_seqlens belongs to the packed layout; padded batches use attention_mask_BS"
        )
    return invalid_BS


def _bool_BS(values: Any, shape_BS: tuple[int, int], name: str) -> torch.Tensor:
    values_BS = torch.as_tensor(values)
    if tuple(values_BS.shape) != shape_BS:
        raise _error(f"{name} must have shape {shape_BS}, got {tuple(values_BS.shape)}")
    return values_BS.to(torch.bool)


def _packed_end(cu_seqlens: Any, packed_len: int) -> int:
    """End of the last packed sequence, after checking cu_seqlens is a valid offset list."""
    offsets = torch.as_tensor(cu_seqlens).long()
    if offsets.dim() != 1 or offsets.numel() < 1 or int(offsets[0]) != 0:
        raise _error(f"cu_seqlens must be [n+1] offsets starting at 0, got {offsets.tolist()}")
    if bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) > packed_len:
        raise _error(f"cu_seqlens must increase and end <= T={packed_len}, got {offsets.tolist()}")
    return int(offsets[-1])


def _select_layers(routes_BSLK: torch.Tensor, moe_layer_ids: Sequence[int] | None) -> torch.Tensor:
    if moe_layer_ids is None:
        return routes_BSLK
    num_recorded = routes_BSLK.shape[2]
    bad = [i for i in moe_layer_ids if not 0 <= i < num_recorded]
    if bad:
        raise _error(f"moe_layer_ids {bad} out of range for {num_recorded} recorded layers")
    return routes_BSLK[:, :, list(moe_layer_ids)]


def _check_experts(routes_BSLK: torch.Tensor, invalid_BS: torch.Tensor, num_experts: int) -> None:
    """Recorded rows must name distinct experts the model has; masked rows are replaced."""
    topk = routes_BSLK.shape[3]
    if topk > num_experts:
        raise _error(f"top-k {topk} exceeds num_experts={num_experts}")
    valid_BSL = (~invalid_BS)[:, :, None].expand(routes_BSLK.shape[:3])
    out_of_range_BSL = (routes_BSLK >= num_experts).any(dim=-1) & valid_BSL
    if bool(out_of_range_BSL.any()):
        b, s, layer = (int(i) for i in out_of_range_BSL.nonzero()[0])
        raise _error(
            f"expert ids {routes_BSLK[b, s, layer].tolist()} at row {b}, position {s}, "
            f"layer {layer} must be < num_experts={num_experts}"
        )
    sorted_BSLK = routes_BSLK.sort(dim=-1).values
    repeated_BSL = (sorted_BSLK[..., 1:] == sorted_BSLK[..., :-1]).any(dim=-1) & valid_BSL
    if bool(repeated_BSL.any()):
        b, s, layer = (int(i) for i in repeated_BSL.nonzero()[0])
        hint = ""
        if not bool(routes_BSLK[:, :, layer][valid_BSL[:, :, layer]].any()):
            hint = (
                f"; layer {layer} is all zeros, as engines record a dense layer: pass config= "
                "(the model's TransformerConfig) or moe_layer_ids to replay only the MoE layers"
            )
        raise _error(
            f"expert ids {routes_BSLK[b, s, layer].tolist()} at row {b}, position {s}, "
            f"layer {layer} repeat an expert{hint}"
        )


class RouteReplay:
    """Replay state of one model's routers while ``replay_routes`` is active.

    Works on the model's own ``RouterReplay`` instances, never on megatron's
    process-global list: that list also holds routers of every other model
    built in the process (a reference model, an earlier test), and
    ``RouterReplay.set_replay_data`` refuses unless it is handed all of them.
    """

    def __init__(self, routers: list[torch.nn.Module], backward_recompute: bool) -> None:
        self._replays = [router.router_replay for router in routers]
        # megatron's TransformerLayer gives its MoE layer the global 1-based layer number.
        self._layer_numbers = [router.layer_number for router in routers]
        self._backward_recompute = backward_recompute

    @property
    def num_layers(self) -> int:
        """How many MoE layers (routers) this replay drives."""
        return len(self._replays)

    def next_microbatch(
        self, indices_per_layer: Sequence[torch.Tensor] | Mapping[int, torch.Tensor]
    ) -> None:
        """Replay ``indices_per_layer`` in the next forward: one ``[T, K]`` tensor per
        router in module order, or (from ``replay_indices(..., config=...)``) a dict
        from 0-based layer index to tensor, each router taking its own layer's."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for replay, indices_TK in zip(self._replays, self._per_router(indices_per_layer)):
            replay.set_target_indices(indices_TK)
            if not self._backward_recompute:
                # set_target_indices also queues the tensor for recompute;
                # without recompute that queue would only hold memory.
                replay.replay_backward_list.pop()
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _per_router(
        self, indices_per_layer: Sequence[torch.Tensor] | Mapping[int, torch.Tensor]
    ) -> list[torch.Tensor]:
        if not isinstance(indices_per_layer, Mapping):
            if len(indices_per_layer) != len(self._replays):
                raise _error(
                    f"got indices for {len(indices_per_layer)} MoE layers, "
                    f"the model has {len(self._replays)} replaying routers"
                )
            return list(indices_per_layer)
        out = []
        for number in self._layer_numbers:
            if number is None:
                raise _error(
                    "a router has no layer_number (not built inside a megatron TransformerLayer): "
                    "pass the indices as a list, one per router in module order"
                )
            if number - 1 not in indices_per_layer:
                raise _error(
                    f"the model's MoE layer {number - 1} (layer_number {number}) has no replay indices; "
                    f"they cover MoE layers {sorted(indices_per_layer)}: does the config match the model?"
                )
            out.append(indices_per_layer[number - 1])
        return out

    def backward_phase(self) -> None:
        """Make activation recompute during backward replay the queued microbatches in order."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if not self._backward_recompute:
            raise _error("backward_phase() needs replay_routes(..., backward_recompute=True)")
        for replay in self._replays:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def _check_num_tokens(self, replay: Any, hidden_states: torch.Tensor) -> None:
        """Refuse a forward whose token count differs from the replayed indices.

        Without this, too few index rows are not an error in megatron: the
        router's gather and scatter accept them and the remaining tokens are
        routed to no expert at all.
        """
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if replay.router_replay_action == RouterReplayAction.REPLAY_BACKWARD:
            if not replay.replay_backward_list:
                raise _error("recompute found no queued indices: more backwards than forwards")
            indices_TK = replay.replay_backward_list[0]
        else:
            indices_TK = replay.target_topk_idx
        num_tokens = hidden_states.shape[:-1].numel()
        if indices_TK is not None and indices_TK.shape[0] != num_tokens:
            raise _error(
                f"router sees {num_tokens} tokens but the replayed indices have "
                f"{indices_TK.shape[0]} rows"
            )

    def clear(self) -> None:
        """Forget all indices and actions, so the routers route freely again."""
        for replay in self._replays:
            replay.clear_indices()
            replay.clear_router_replay_action()


@contextlib.contextmanager
def replay_routes(
    model_or_layers: torch.nn.Module | Iterable[torch.nn.Module],
    indices_per_layer: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
    *,
    backward_recompute: bool = True,
) -> Iterator[RouteReplay]:
    """Force the model's MoE routers to the given experts until the block exits.

    ``model_or_layers`` is a model, a list of model chunks, or MoE layers;
    routers are taken in module order, which in megatron's TransformerBlock
    is layer order. ``indices_per_layer`` comes from ``replay_indices``: a
    list (one per router, in that order) or, with ``config``, a dict by layer
    (each router takes its own layer's, so a pipeline stage's model chunk
    replays the layers it holds; routers of a ``.mtp`` block are left out,
    as engines record no routes for multi-token-prediction layers). Pass
    ``backward_recompute=False`` for forward-only passes or models without
    activation recompute. Replay state is cleared on exit, also on error.
    """
    if isinstance(indices_per_layer, Mapping):
        model_or_layers = _decoders(model_or_layers)
    routers = _replaying_routers(model_or_layers)
    replay = RouteReplay(routers, backward_recompute)
    hooks = [
        router.register_forward_pre_hook(
            lambda module, args: replay._check_num_tokens(module.router_replay, args[0])
        )
        for router in routers
    ]
    try:
        replay.next_microbatch(indices_per_layer)
        yield replay
    finally:
        for hook in hooks:
            hook.remove()
        replay.clear()


def _decoders(model_or_layers: torch.nn.Module | Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """A GPTModel's decoder (not its MTP block, whose layer numbers restart at 1)."""
    modules = [model_or_layers] if isinstance(model_or_layers, torch.nn.Module) else list(model_or_layers)
    decoders = [getattr(module, "decoder", None) for module in modules]
    return [module if decoder is None else decoder for module, decoder in zip(modules, decoders)]


def _replaying_routers(model_or_layers: torch.nn.Module | Iterable[torch.nn.Module]) -> list:
    """The model's routers that own a RouterReplay, in module order, refusing unusable ones."""
    from megatron.core.transformer.moe.router import TopKRouter

    modules = [model_or_layers] if isinstance(model_or_layers, torch.nn.Module) else model_or_layers
    routers: dict[int, TopKRouter] = {}
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, TopKRouter):
                routers.setdefault(id(sub), sub)
    if not routers:
        raise _error("no megatron TopKRouter found in the model: nothing to replay")
    for router in routers.values():
        _check_router(router)
    return list(routers.values())


def _check_router(router: Any) -> None:
    config = router.config
    if router.router_replay is None:
        raise _error(
            "router has no RouterReplay: build the model with moe_enable_routing_replay=True"
        )
    if router.router_replay.router_replay_action is not None:
        raise _error("router replay is already active on this model (nested replay_routes?)")
    if config.moe_router_fusion:
        raise _error("moe_router_fusion=True bypasses RouterReplay; set it False to replay routes")
    if router.routing_type == "sinkhorn":
        raise _error("sinkhorn routing bypasses RouterReplay; use top-k routing to replay routes")


def _error(message: str) -> ValidationError:
    return ValidationError(message, rule=_RULE)
