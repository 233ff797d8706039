"""Tensor parallelism for the built-in decoders (:class:`~dash_trt.model.DashForCausalLM` and
Unlimited-OCR-2's :class:`~dash_trt.models.unlimited_ocr2.UnlimitedOCR2ForCausalLM`).

Megatron-style, over ``torch.distributed`` (NCCL on GPUs, one process per GPU launched by
``torchrun``; gloo on CPUs, which is how the tests run it):

- attention heads and KV heads split in contiguous groups: rank r holds query heads
  ``[r * H/tp, (r+1) * H/tp)`` and the KV heads they read, ``[r * Hkv/tp, (r+1) * Hkv/tp)``
  (GQA keeps its mapping), its rows of ``q_proj``/``k_proj``/``v_proj``, its columns of
  ``o_proj``, and a KV cache of its own KV heads only;
- the MLP's ``gate_proj``/``up_proj`` rows and ``down_proj`` columns split alike;
- Unlimited-OCR-2's mixture of experts split the same way inside every expert (vLLM's tensor
  parallelism without expert parallelism): each rank holds a ``1/tp`` slice of the intermediate
  width of every routed expert and of the shared experts, the ``gate`` (router) is replicated,
  so every rank picks the same experts for a token and computes its part of each; the partial
  sums of all experts and the shared ones are added by one all-reduce after the layer
  (:class:`AllReduced`), not one an expert;
- one all-reduce after ``o_proj`` and one after ``down_proj`` (:class:`RowParallelLinear`) or
  after the mixture of experts;
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
    "AllReduced",
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


class AllReduced(nn.Module):
    """``module``'s output summed over the ranks (one all-reduce): a mixture of experts whose
    experts each hold a slice of their intermediate width gives every rank the full output."""

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        self.module = module
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        y = self.module(x)
        dist.all_reduce(y, group=self.group)
        return y


def _local_config(model, world: int):
    """The shard's config: the rank's heads, KV heads, MLP width and (Unlimited-OCR-2) expert width."""
    from .models.config import LANGUAGE_SECTION
    from .models.unlimited_ocr2 import UnlimitedOCR2ForCausalLM

    cfg = model.config
    s = shard_sizes(cfg, 0, world)
    local = dataclasses.replace(
        cfg, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, intermediate_size=s.intermediate
    )
    if isinstance(model, UnlimitedOCR2ForCausalLM):
        moe = model.moe_config
        for name, n in (
            ("moe_intermediate_size", moe.moe_intermediate_size),
            ("n_shared_experts x moe_intermediate_size", moe.n_shared_experts * moe.moe_intermediate_size),
        ):
            if n % world:
                raise TensorParallelError(f"{name} ({n}) is not divisible by the tensor-parallel size {world}")
        section = LANGUAGE_SECTION if cfg.nested else None
        keys = {"moe_intermediate_size": moe.moe_intermediate_size // world}
        if section:
            extra = {**cfg.extra, section: {**cfg.language, **keys}}
        else:
            extra = {**cfg.extra, **keys}
        local = dataclasses.replace(local, extra=extra)
    return local, s


def shard_model(model, rank: int, world: int, group=None):
    """This rank's shard of ``model`` (a :class:`~dash_trt.model.DashForCausalLM` or an
    :class:`~dash_trt.models.unlimited_ocr2.UnlimitedOCR2ForCausalLM`): a model of the same
    class whose config holds the rank's heads, KV heads, MLP and expert widths (so its caches,
    kernels and the model contract see the local sizes), the split weights, and the
    all-reducing outputs. ``world == 1`` returns ``model`` itself. The shard lives where
    ``model`` does; move it with ``.to(device)``."""
    from .models.decoder import DashForCausalLM
    from .models.unlimited_ocr2 import MoE, UnlimitedOCR2ForCausalLM

    if world == 1:
        return model
    if type(model) not in (DashForCausalLM, UnlimitedOCR2ForCausalLM):
        raise TensorParallelError(
            f"tensor parallelism splits the built-in DashForCausalLM and UnlimitedOCR2ForCausalLM, not "
            f"{type(model).__name__} (a model of your own splits its own projections)"
        )
    cfg = model.config
    local_cfg, _ = _local_config(model, world)
    s = shard_sizes(cfg, rank, world)
    d = cfg.head_dim
    with torch.device("meta"):
        shard = type(model)(local_cfg)
    shard = shard.to_empty(device=model.device).to(model.dtype)
    # The split of each attention projection's weight [out, in]: (dim, start, size). The MLP's,
    # the experts' and the shared experts' gate/up rows and down columns split evenly (each its
    # own width); every other tensor is replicated.
    heads = {
        "q_proj": (0, s.head0 * d, s.heads * d),
        "k_proj": (0, s.kv_head0 * d, s.kv_heads * d),
        "v_proj": (0, s.kv_head0 * d, s.kv_heads * d),
        "o_proj": (1, s.head0 * d, s.heads * d),
    }
    width = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}
    local = {}
    for name, w in model.state_dict().items():
        parts = name.split(".")
        owner = parts[-2] if len(parts) > 1 else ""  # "layers.0.self_attn.q_proj.weight" -> "q_proj"
        if "dash_router" in parts or not (owner in heads or owner in width):
            local[name] = w  # the router's own q_proj / k_proj are replicated too
        elif owner in heads:
            local[name] = w.narrow(*heads[owner]).contiguous()
        else:
            n = w.shape[width[owner]] // world
            local[name] = w.narrow(width[owner], rank * n, n).contiguous()
    shard.load_state_dict(local)  # copies; strict: a name the shard lacks is an error
    if cfg.tie_word_embeddings:  # to_empty gave lm_head a storage of its own
        shard.lm_head.weight = shard.embed_tokens.weight
    for layer in shard.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj.weight.data, group)
        if isinstance(layer.mlp, MoE):
            layer.mlp = AllReduced(layer.mlp, group)
        else:
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
