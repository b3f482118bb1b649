"""PoSE, positional skip-wise training (Zhu et al., ICLR 2024, arXiv:2309.10400): a sample of
c contiguous tokens keeps positions 0..l-1 for its first chunk and jumps by a random skip u in
[0, N - c] before its second, so training at c tokens shows the model relative distances up to N."""

from __future__ import annotations

import hashlib

import torch


def skipped_positions(length: int, max_length: int, generator: torch.Generator) -> torch.LongTensor:
    """[length] position ids in two chunks: the split l in [1, length - 1] and the skip u in
    [0, max_length - length] drawn from `generator`; strictly increasing, the last <= max_length - 1."""
    if not 2 <= length <= max_length:
        raise ValueError(f"PoSE needs 2 <= sequence length <= patched length, got {length} and {max_length}")
    split = int(torch.randint(1, length, (), generator=generator))
    skip = int(torch.randint(0, max_length - length + 1, (), generator=generator))
    positions = torch.arange(length)
    positions[split:] += skip
    return positions


class SkipPositions:
    """The PoSE position ids of each training sample, a pure function of the seed and the
    sample's place in the data order (DataOrder.samples), so a resumed run draws what the
    interrupted one would have."""

    def __init__(self, length: int, max_length: int, seed: int):
        self.length, self.max_length, self.seed = length, max_length, seed

    def generator(self, sample: int) -> torch.Generator:
        # a hash, not seed * k + sample: no two (seed, sample) pairs share a stream
        key = hashlib.sha256(f"pose:{self.seed}:{sample}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))

    def __call__(self, samples: list[int]) -> torch.LongTensor:
        """[len(samples), length] position ids, one row per sample."""
        return torch.stack([skipped_positions(self.length, self.max_length, self.generator(s)) for s in samples])
