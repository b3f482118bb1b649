"""Measuring one model at one length: perplexity, throughput and peak memory, each in a fresh
process."""

from __future__ import annotations

import math
import multiprocessing
import resource
import time

import torch
import torch.nn.functional as F

import rope_ext

from .train import load_checkpoint


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def evaluate_cell(checkpoint: str, method: str | None, params: dict, length: int, tokens: torch.LongTensor, threads: int) -> dict:
    """Perplexity, throughput and peak memory of one model at one length; run in a fresh process.

    `tokens` holds n * length + 1 tokens: n non-overlapping windows, each scored on every token."""
    torch.set_num_threads(threads)
    model = load_checkpoint(checkpoint)
    patch = None
    if method is not None:
        info = rope_ext.patch(model, method, factor=length / model.config.max_position_embeddings, **params)
        patch = {"method": info.method, "factor": info.factor, "params": info.params, "max_length": info.max_length}
    windows = tokens[:-1].view(-1, length)
    targets = tokens[1:].view(-1, length)
    with torch.inference_mode():
        model(input_ids=windows[:1, :8])  # warm-up: thread pool and allocator, not part of the peak
        baseline = max_rss_mb()
        nll = 0.0
        start = time.perf_counter()
        for inputs, labels in zip(windows, targets):
            logits = model(input_ids=inputs[None]).logits[0]
            nll += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        seconds = time.perf_counter() - start
    peak = max_rss_mb()
    # the whole process, model loading included: evaluation processes are grandchildren of the
    # study (children of the fork server), so RUSAGE_CHILDREN there would never see them
    process_cpu = cpu_seconds()
    return {
        "ppl": math.exp(nll / targets.numel()),
        "nll": nll / targets.numel(),
        "tokens": targets.numel(),
        "windows": len(windows),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(targets.numel() / seconds),
        "peak_mb": round(peak - baseline, 1),
        "process_peak_mb": round(peak, 1),
        "process_cpu_seconds": round(process_cpu, 2),
        "patch": patch,
    }


def evaluation_pool():
    """A pool whose every task runs in a new process forked from a server that has imported torch
    but never computed anything: each cell starts from the same clean memory state."""
    context = multiprocessing.get_context("forkserver")
    # this module too, so that no cell pays for importing it
    context.set_forkserver_preload([__name__, "torch", "transformers"])
    return context.Pool(1, maxtasksperchild=1)
