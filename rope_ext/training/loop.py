"""The pieces of a training loop: the next-token loss, one optimizer step, the loss to report."""

from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F


def next_token_loss(model, tokens: torch.LongTensor) -> torch.Tensor:
    """Mean next-token NLL; `tokens` carry one extra token, so the inputs are tokens[:, :-1]."""
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def optimizer_step(model, optimizer, schedule, loss: torch.Tensor, grad_clip: float) -> None:
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    schedule.step()


class RecentLoss:
    """The mean of the last 20 losses: what progress bars and train logs report."""

    def __init__(self):
        self.values: deque[float] = deque(maxlen=20)

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)
