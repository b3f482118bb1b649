"""The fine-tune's progress: the bar, the clock that leaves the pauses (evals, checkpoints) out
of the training time and the throughput, and the per-step log that train_log.json keeps and
accelerate's trackers receive."""

from __future__ import annotations

import contextlib
import json
import time

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, start: int, tokens_per_step: int, desc: str, disable: bool):
        self.bar = tqdm(total=total, initial=start, disable=disable, unit="step", desc=desc)
        self.start, self.tokens_per_step = start, tokens_per_step
        self.began, self.pauses = time.perf_counter(), []
        self.last = 0.0  # training seconds at the end of the previous step

    def seconds(self) -> float:
        """Training seconds so far."""
        return time.perf_counter() - self.began - sum(self.pauses)

    def step(self, done: int, loss: float, lr: float) -> float:
        """Advance the bar past step `done`; returns that step's tokens per second."""
        elapsed = self.seconds()
        rate, self.last = self.tokens_per_step / (elapsed - self.last), elapsed
        self.bar.update(1)
        self.bar.set_postfix(
            loss=f"{loss:.4f}", tok_s=f"{self.tokens_per_step * (done - self.start) / elapsed:,.0f}", lr=f"{lr:.2e}"
        )
        return rate

    @contextlib.contextmanager
    def paused(self):
        paused = time.perf_counter()
        yield
        self.pauses.append(time.perf_counter() - paused)

    def close(self) -> float:
        """The training seconds in all."""
        self.bar.close()
        return self.seconds()


def tracker_config(cfg: dict) -> dict:
    """cfg as the trackers take hyperparameters: one level of "section.key", each value a bool,
    number or string (lists, mappings and None as JSON)."""
    flat = {}
    for section, values in cfg.items():
        for key, value in values.items():
            scalar = isinstance(value, (bool, int, float, str))
            flat[f"{section}.{key}"] = value if scalar else json.dumps(value, sort_keys=True)
    return flat


class StepLog:
    """Per optimizer step: the step's loss (mean over its micro-batches and ranks), the learning
    rate it stepped with and its tokens per second, in `history` and in the trackers."""

    def __init__(self, accelerator, history: list[dict]):
        self.accelerator, self.history = accelerator, history

    def __call__(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        values = {"loss": loss, "lr": lr, "tokens_per_s": tokens_per_s}
        self.history.append({"step": step, **values})
        self.accelerator.log({f"train/{k}": v for k, v in values.items()}, step=step)
