"""The policy on N ranks of torch.distributed: process group from torchrun, FSDP2 sharding, full state dict.

    info = init_from_env()                      # torchrun's RANK/WORLD_SIZE/LOCAL_RANK; gloo on CPU, nccl on GPU
    model = shard_model(model, info.device)     # fully_shard per decoder layer + the root
    optimizer = torch.optim.AdamW(model.parameters(), ...)   # after sharding: it holds the local shards
    metrics = train_step(model, optimizer, batch, adv, loss_cfg, ...)      # forkrl/rl/step.py, on every rank
    save_full_pretrained(model, out_dir, tokenizer)          # rank 0 writes an HF checkpoint

FSDP2 (`torch.distributed.fsdp.fully_shard`): each decoder layer is one FSDP unit (its parameters are
all-gathered for its forward/backward and resharded after), the root holds the rest (embeddings, final norm,
lm_head) and stays gathered from its forward to the end of its backward (FSDP2's own default for the root): the
train step's loss reads the lm_head weight after the forward (forkrl/rl/entropy.py), and resharding the root in
between would only gather it again (a no-grad forward reshards it explicitly: forkrl/rl/collectives.py
`reshard_root`). Gradients are reduce-scattered with divide factor 1 (SUM): `train_step` gives each rank its
share of the globally normalized loss, so the sum is the 1-rank gradient. On CUDA the default mixed precision is
bf16 compute with fp32 master weights and fp32 gradient reduction; on CPU everything stays fp32. Activation
checkpointing (optional, `enable_activation_checkpointing`, also on one process) is the HF model's own
(non-reentrant), applied before sharding.

The trainer's ranks use it through `forkrl/training/policy.py` (`load_policy` shards when the process group
has > 1 rank) and `forkrl/training/ranks.py`; their checkpoints (gathered HF weights + AdamW shards with
torch.distributed.checkpoint) in `forkrl/weights/sharded.py`; the push streams the shards layer by layer into
the rollout services through vLLM's weight-transfer API (forkrl/weights/transfer_gloo.py, docs/scaling.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "decoder_layers", "enable_activation_checkpointing", "full_state_dict", "init_from_env",
           "save_full_pretrained", "shard_model"]


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_from_env(backend: str | None = None) -> DistInfo:
    """Join the process group torchrun describes (env://); a single process without torchrun stays alone.

    backend: None = nccl when CUDA is present, else gloo. Each rank uses cuda:LOCAL_RANK on GPU.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: end with its agent, also when that was SIGKILLed
        from forkrl.runtime import die_with

        die_with(os.getppid())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (`model.model.layers` for Llama/Qwen2/Mistral...)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return list(layers)
    found = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not found:
        raise ValueError(f"no decoder layers found in {type(model).__name__} (expected model.model.layers)")
    return found


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them (HF's
    `gradient_checkpointing_enable`, non-reentrant: no input needs requires_grad). Saved per layer: its input.
    The recomputation repeats the same operations on the same numbers (no dropout in these models, and the
    non-reentrant checkpoint restores the RNG state anyway), so the step's numbers do not change; it costs about
    one more forward of the layers. In train() mode only, as HF applies it."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]


def shard_model(
    model: torch.nn.Module,
    device: torch.device | str,
    *,
    mixed_precision: bool | None = None,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """fully_shard each decoder layer and the root over all ranks of the default group (1-D mesh).

    mixed_precision: None = on for CUDA (bf16 params in compute, fp32 reduce), off on CPU. The model must
    be fp32 (the master weights) and identical on every rank (same seed or same checkpoint) before the call.
    Returns the same module, now an FSDPModule; build the optimizer afterwards. reshard_after_forward applies to the
    decoder layers; the root stays gathered until its backward (module docstring).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError("shard_model needs an initialized process group (init_from_env under torchrun)")
    dev = torch.device(device)
    model.to(dev)
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    mp = dev.type == "cuda" if mixed_precision is None else mixed_precision
    kwargs: dict[str, Any] = {"mesh": init_device_mesh(dev.type, (dist.get_world_size(),))}
    if mp:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # SUM: each rank's loss is already its share of the global one
            m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded fp32 state dict on CPU, on rank 0 (an empty dict on the other ranks). A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_full_pretrained(model: torch.nn.Module, out_dir: Path | str, tokenizer: Any = None) -> Path | None:
    """Gather the full state (every rank must call) and write an HF save_pretrained checkpoint on rank 0.

    Returns the directory on rank 0, None elsewhere. The files are loadable by transformers and vLLM.
    """
    state = full_state_dict(model)
    out = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        out = Path(out_dir)
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    if dist.is_initialized():
        dist.barrier()
    return out
