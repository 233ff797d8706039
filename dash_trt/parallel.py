"""Tensor parallelism for the built-in decoder (:class:`~dash_trt.model.DashForCausalLM`).

Megatron-style, over ``torch.distributed`` (NCCL on GPUs, one process per GPU launched by
``torchrun``; gloo on CPUs, which is how the tests run it):

- attention heads and KV heads split in contiguous groups: rank r holds query heads
  ``[r * H/tp, (r+1) * H/tp)`` and the KV heads they read, ``[r * Hkv/tp, (r+1) * Hkv/tp)``
  (GQA keeps its mapping), its rows of ``q_proj``/``k_proj``/``v_proj``, its columns of
  ``o_proj``, and a KV cache of its own KV heads only;
- the MLP's ``gate_proj``/``up_proj`` rows and ``down_proj`` columns split alike;
- one all-reduce after ``o_proj`` and one after ``down_proj`` (:class:`RowParallelLinear`);
- everything else replicated: embeddings, norms, ``lm_head``, and the DASH router
  (``dash_router``: its ``q_proj``, ``k_proj``, norms and ``head_cls``). The router is shared by
  all heads of a token, and
  its inputs (the hidden states) are the same on every rank after each all-reduce, so every
  rank routes for itself and selects the same blocks: no broadcast of the selection, at the
  price of scoring on every rank (the routing is a few percent of a step; its index cache,
  ``index_key``/``summary``, is replicated, ``index_dim`` values a token against
  ``2 * Hkv * head_dim`` for the K/V that are split).

Every rank runs the same scheduler on the same requests and gets the same tokens (an
all-reduce leaves the same bits on every rank), so :func:`dash_trt.model.generate` and the
serving runtime run unchanged on a shard. On GPUs the runtime captures decode steps in CUDA
graphs, all-reduces included: NCCL collectives can be captured, gloo's cannot (pass
``cuda_graphs=False`` with gloo on CUDA tensors). Tested on CPUs (gloo); not yet run with NCCL
on several GPUs.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "TensorParallelError",
    "ShardSizes",
    "shard_sizes",
    "RowParallelLinear",
    "shard_model",
    "init_from_env",
    "NVLS_OFF",
]

#: Environment every multi-GPU launcher sets: NVLink multicast (NVLS, symmetric-memory
#: multicast) can take a shared host's GPUs out of service, so it stays off.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class TensorParallelError(ValueError):
    """A model that cannot be split this way (sizes not divisible, another model class)."""


@dataclass(frozen=True)
class ShardSizes:
    """One rank's share: its query heads, KV heads and MLP width, and where they start."""

    heads: int
    kv_heads: int
    intermediate: int
    head0: int
    kv_head0: int
    inter0: int


def shard_sizes(config, rank: int, world: int) -> ShardSizes:
    """Rank ``rank`` of ``world``'s share of ``config`` (a :class:`~dash_trt.model.DashModelConfig`);
    :class:`TensorParallelError` when heads, KV heads or the MLP width do not divide."""
    if world < 1 or not 0 <= rank < world:
        raise TensorParallelError(f"rank {rank} is not in a world of {world}")
    h, hkv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    for name, n in (("num_attention_heads", h), ("num_key_value_heads", hkv), ("intermediate_size", inter)):
        if n % world:
            raise TensorParallelError(f"{name} ({n}) is not divisible by the tensor-parallel size {world}")
    return ShardSizes(
        h // world, hkv // world, inter // world, rank * h // world, rank * hkv // world, rank * inter // world
    )


class RowParallelLinear(nn.Module):
    """``linear`` over this rank's slice of the input features, then the sum over ranks
    (all-reduce): the full layer's output on every rank. No bias (the built-in decoder's
    projections have none)."""

    def __init__(self, weight: torch.Tensor, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


def shard_model(model, rank: int, world: int, group=None):
    """This rank's shard of ``model`` (a :class:`~dash_trt.model.DashForCausalLM`): a model of
    the same class whose config holds the rank's heads, KV heads and MLP width (so its caches,
    kernels and the model contract see the local sizes), the split weights, and the
    all-reducing output projections. ``world == 1`` returns ``model`` itself. The shard lives
    where ``model`` does; move it with ``.to(device)``."""
    from .models.decoder import DashForCausalLM

    if world == 1:
        return model
    if type(model) is not DashForCausalLM:
        raise TensorParallelError(
            f"tensor parallelism splits the built-in DashForCausalLM, not "
            f"{type(model).__name__} (a model of your own splits its own projections)"
        )
    cfg = model.config
    s = shard_sizes(cfg, rank, world)
    d = cfg.head_dim
    local_cfg = dataclasses.replace(
        cfg, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, intermediate_size=s.intermediate
    )
    with torch.device("meta"):
        shard = DashForCausalLM(local_cfg)
    shard = shard.to_empty(device=model.device).to(model.dtype)
    # The split of each projection's weight [out, in], by the module that owns it: (dim, start, size);
    # every other tensor is replicated.
    split = {
        "q_proj": (0, s.head0 * d, s.heads * d),
        "k_proj": (0, s.kv_head0 * d, s.kv_heads * d),
        "v_proj": (0, s.kv_head0 * d, s.kv_heads * d),
        "o_proj": (1, s.head0 * d, s.heads * d),
        "gate_proj": (0, s.inter0, s.intermediate),
        "up_proj": (0, s.inter0, s.intermediate),
        "down_proj": (1, s.inter0, s.intermediate),
    }
    local = {}
    for name, w in model.state_dict().items():
        parts = name.split(".")
        owner = parts[-2]  # "layers.0.self_attn.q_proj.weight" -> "q_proj"
        # the router's own q_proj / k_proj ("...self_attn.dash_router.q_proj.weight") are replicated
        sharded = owner in split and parts[-3] != "dash_router"
        local[name] = w.narrow(*split[owner]).contiguous() if sharded else w
    shard.load_state_dict(local)  # copies; strict: a name the shard lacks is an error
    if cfg.tie_word_embeddings:  # to_empty gave lm_head a storage of its own
        shard.lm_head.weight = shard.embed_tokens.weight
    for layer in shard.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj.weight.data, group)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj.weight.data, group)
    shard.dash_layers()  # the contract, at the local sizes
    return shard.eval()


def init_from_env(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``): NCCL with this process's GPU (``cuda:LOCAL_RANK``) when
    CUDA is there, else gloo on the CPU; NVLink multicast off (:data:`NVLS_OFF`) before NCCL
    starts. Returns ``(rank, world size, device)``."""
    import torch.distributed as dist

    for key, value in NVLS_OFF.items():
        os.environ.setdefault(key, value)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise TensorParallelError("RANK and WORLD_SIZE are not set: launch with torchrun --nproc-per-node N")
    cuda = torch.cuda.is_available() and backend != "gloo"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"), device_id=device if cuda else None)
    return dist.get_rank(), dist.get_world_size(), device
