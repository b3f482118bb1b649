"""The optimizer every recipe trains with: AdamW, then linear warmup and cosine decay."""

from __future__ import annotations

import torch
from transformers import get_cosine_schedule_with_warmup


def adamw_cosine(model, lr: float, weight_decay: float, warmup_steps: int, steps: int, betas=(0.9, 0.999)):
    """(AdamW over the trainable parameters, its warmup + cosine schedule over `steps`)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Norm gains and biases are not decayed: shrinking them only fights the normalisation.
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=tuple(betas),
    )
    return optimizer, get_cosine_schedule_with_warmup(optimizer, warmup_steps, steps)
