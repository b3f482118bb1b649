"""The accelerate side of a fine-tune: the Accelerator and its precision, the data- and
context-parallel ranks, one optimizer step over the micro-batches, and the replicas' agreement."""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object

from .config import HALF_PRECISION


def has_accelerator() -> bool:
    return torch.accelerator.is_available()  # any device type: CUDA, XPU, MPS, ...


def choose_precision(setting: str | None, dtype: str = "float32") -> str | None:
    """auto: the autocast a half-precision base needs; for a float32 base bf16 on a GPU that has
    it, else fp16 on a GPU, fp32 on CPU. None leaves accelerate's own setting."""
    if setting != "auto":
        return setting
    if dtype in HALF_PRECISION:
        return HALF_PRECISION[dtype]
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "no"


def make_accelerator(cfg: dict, out) -> Accelerator:
    """The Accelerator for `cfg`: its precision, gradient accumulation and trackers (writing
    under `out`)."""
    run = cfg["training"]
    return Accelerator(
        mixed_precision=choose_precision(run["precision"], cfg["model"]["dtype"]),
        gradient_accumulation_steps=run["grad_accum"],
        log_with=cfg["output"]["log_with"] or None,
        project_dir=str(out),
        # On a machine without an accelerator this makes a multi-process launch (torchrun,
        # `accelerate launch --multi_gpu`, recipes/configs/accelerate/cpu_ddp.yaml) CPU DDP over gloo.
        cpu=not has_accelerator(),
    )


def context_parallel_size(accelerator) -> int:
    pc = accelerator.parallelism_config
    return pc.cp_size if pc is not None and pc.cp_enabled else 1


def data_parallel_rank(accelerator) -> tuple[int, int]:
    """(rank, size) over the ranks that get different data: ranks of one context-parallel group
    share a batch."""
    pc = accelerator.parallelism_config
    if pc is not None and pc.cp_enabled:
        if pc.data_parallel_size == 1:
            return 0, 1
        return accelerator.torch_device_mesh["dp"].get_local_rank(), pc.data_parallel_size
    return accelerator.process_index, accelerator.num_processes


def is_sharded(accelerator) -> bool:
    """Whether every rank holds only a shard of the model (FSDP, DeepSpeed), so that every rank
    takes part in each forward; a replicated model (DDP, one process) runs on each rank alone."""
    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


def prepare(accelerator, model, optimizer, batch_size: int):
    """(model, optimizer) prepared for the launch. The scheduler is not prepared: the training loop
    steps it once per optimizer step (a prepared one would step once per process)."""
    if accelerator.state.deepspeed_plugin is not None:
        # No dataloader goes through prepare(), so DeepSpeed is told the micro-batch size here.
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = batch_size
    return accelerator.prepare(model, optimizer)


def train_step(accelerator, model, optimizer, scheduler, batches, run: dict, cp_size: int) -> float:
    """One optimizer step over `batches`, the run["grad_accum"] micro-batches of this rank: each
    [batch_size, seq_len + 1] tokens with their [batch_size, seq_len] position ids, or None for
    0..seq_len-1; returns the step's loss averaged over the ranks."""
    step_loss = torch.zeros((), device=accelerator.device)
    for batch, positions in batches:
        batch = batch.to(accelerator.device)
        inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        if positions is None:
            mask, positions = None, torch.arange(inputs.shape[1], device=accelerator.device)[None].expand(len(inputs), -1).clone()
        else:
            # Without a mask transformers reads a jump in the position ids as the start of another
            # packed document and stops attention there; an all-ones mask keeps one causal sequence.
            mask, positions = torch.ones_like(inputs), positions.to(accelerator.device)
        # Context parallelism shards the sequence of every buffer in place (a no-op without it).
        split = (
            accelerator.maybe_context_parallel(
                buffers=[inputs, labels, positions], buffer_seq_dims=[1, 1, 1], no_restore_buffers={inputs, labels, positions}
            )
            if cp_size > 1
            else contextlib.nullcontext()
        )
        with accelerator.accumulate(model), split:
            logits = model(input_ids=inputs, position_ids=positions, attention_mask=mask, use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            accelerator.backward(loss)
            if accelerator.sync_gradients and run["grad_clip"]:
                accelerator.clip_grad_norm_(model.parameters(), run["grad_clip"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step_loss += loss.detach() / run["grad_accum"]
    if not optimizer.step_was_skipped:
        scheduler.step()
    return accelerator.reduce(step_loss, "mean").item()


def param_digest(model) -> str:
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def replica_digests(accelerator, model) -> list[str] | None:
    """Under DDP, where every rank keeps a full replica, each rank's digest of the trained weights,
    checked to agree bit for bit; None for other launches."""
    if accelerator.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        return None
    digests = gather_object([param_digest(accelerator.unwrap_model(model))])
    if len(set(digests)) > 1:
        raise RuntimeError(f"data-parallel ranks ended with different weights: {digests}")
    return digests
