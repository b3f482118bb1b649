"""The fine-tune's evaluation: held-out perplexity at the patched window (the training length, or
under PoSE the length the skipped positions reach), with full attention."""

from __future__ import annotations

import contextlib

import torch
from tqdm import tqdm

from rope_ext.evals.perplexity import evaluate as perplexity

from .distributed import is_sharded
from .s2_attention import AttentionSwitch


def evaluate(model, documents: list, seq_len: int) -> dict:
    """Perplexity at `seq_len` tokens (rope_ext.evals.perplexity, non-overlapping windows)."""
    was_training = model.training
    model.eval()
    # FSDP2 keeps the root module's own parameters (the final norm) sharded outside the root's
    # forward, and takes as its root the first module to run forward. The eval calls the decoder
    # and the head separately: one token through the whole model first makes it the root (else
    # the embeddings' unit is, and FSDP2 refuses its two modules), then unshard() gathers them.
    gathered = hasattr(model, "unshard") and hasattr(model, "reshard")
    if gathered:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), use_cache=False)
        model.unshard()
    try:
        result = perplexity(model, documents, [seq_len], progress=False)[seq_len]
    finally:
        if gathered:
            model.reshard()
        model.train(was_training)
    return {"ppl": round(result["ppl"], 4), "nll": round(result["nll"], 5), "tokens": result["tokens"]}


class HeldOut:
    """Evaluates the model in training on `documents` at `seq_len` tokens, as it will be used (full
    attention), keeps one result per step in `evals` and hands it to the trackers. `autocast`:
    under the launch's autocast, which a half-precision base needs (its float32 trainable norms
    feed half-precision matmuls); a float32 base is evaluated in float32."""

    def __init__(
        self,
        accelerator,
        model,
        documents: list,
        seq_len: int,
        attention: AttentionSwitch,
        evals: list[dict],
        autocast: bool = False,
    ):
        self.accelerator, self.model, self.documents, self.seq_len = accelerator, model, documents, seq_len
        self.attention, self.evals, self.autocast = attention, evals, autocast

    def __call__(self, step: int) -> None:
        accelerator = self.accelerator
        if accelerator.is_main_process or is_sharded(accelerator):
            self.attention.full()
            with accelerator.autocast() if self.autocast else contextlib.nullcontext():
                result = {"step": step, **evaluate(accelerator.unwrap_model(self.model), self.documents, self.seq_len)}
            self.attention.sparse()
            self.evals[:] = [e for e in self.evals if e["step"] != step] + [result]
            accelerator.log({"eval/ppl": result["ppl"], "eval/nll": result["nll"]}, step=step)
            if accelerator.is_main_process:
                tqdm.write(f"step {step}: held-out PPL at {self.seq_len} tokens = {result['ppl']:.3f}")
        accelerator.wait_for_everyone()
