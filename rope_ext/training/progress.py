"""The fine-tune's progress bar and its clock, which leaves the pauses (evals, checkpoints) out of
the training time and the throughput."""

from __future__ import annotations

import contextlib
import time

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, start: int, tokens_per_step: int, desc: str, disable: bool):
        self.bar = tqdm(total=total, initial=start, disable=disable, unit="step", desc=desc)
        self.start, self.tokens_per_step = start, tokens_per_step
        self.began, self.pauses = time.perf_counter(), []

    def seconds(self) -> float:
        """Training seconds so far."""
        return time.perf_counter() - self.began - sum(self.pauses)

    def step(self, done: int, loss: float, lr: float) -> None:
        elapsed = self.seconds()
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{self.tokens_per_step * (done - self.start) / elapsed:,.0f}", lr=f"{lr:.2e}")

    @contextlib.contextmanager
    def paused(self):
        paused = time.perf_counter()
        yield
        self.pauses.append(time.perf_counter() - paused)

    def close(self) -> float:
        """The training seconds in all."""
        self.bar.close()
        return self.seconds()
