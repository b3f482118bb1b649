"""Which packed sequence each step, micro-step and rank of a fine-tune trains on."""

from __future__ import annotations

import torch


class DataOrder:
    """Which packed sequence each (step, micro-step, rank, row) trains on: a fresh seeded
    permutation per pass over the data. A pure function of the position, so a resumed run sees
    exactly the batches the interrupted one would have."""

    def __init__(self, n: int, seed: int, batch_size: int, grad_accum: int, world: int):
        self.n, self.seed = n, seed
        self.batch_size, self.grad_accum, self.world = batch_size, grad_accum, world
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))}
        return self._perms[epoch]

    def samples(self, step: int, micro: int, rank: int) -> range:
        """The places in the run's sequence of samples that the rows of this micro-batch fill."""
        first = ((step * self.grad_accum + micro) * self.world + rank) * self.batch_size
        return range(first, first + self.batch_size)

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        return [int(self._perm(k // self.n)[k % self.n]) for k in self.samples(step, micro, rank)]
