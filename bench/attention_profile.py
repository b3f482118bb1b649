"""Where a patched forward spends its time: torch.profiler's table of the ops of one prefill (or of
decode steps) on a 2-layer random Llama of SmolLM2-135M's attention and MLP shapes (576 hidden, 9
query heads on 3 key/value heads of 64, 1536 MLP), fp32 (or --dtype), one thread, plain and each
--methods. With --time R, no profile: the prefill of plain and of each method timed R times in
turn (CPU time, after one untimed run each), so that noise on a shared machine reaches them alike,
and each method's ratio to plain (fastest over fastest, median over median, and the spread of the
R per-repeat ratios).

A 2-layer model keeps the attention-side work visible beside the linear layers: it is the proxy for
what a patch adds per layer, which a GPU with many layers shows again once launches dominate. The
prompt is --length tokens over a trained window of --window (8x by default); --decode profiles
--steps greedy steps after that prompt instead of the prefill. Each table lists the ops by their
own CPU time, the total at its foot.

    python bench/attention_profile.py --methods dynamic                      # prefill, 4096 over 512
    python bench/attention_profile.py --methods self_extend sink_window --decode --length 2048
    python bench/attention_profile.py --methods dynamic --time 5 --dtype bfloat16      # the ratios
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import rope_ext
from rope_ext.evals.compare import parse_specs

# SmolLM2-135M's config.json (HuggingFaceTB/SmolLM2-135M) for these fields, two of its 30 layers
SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def random_llama(window: int, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=1024, num_hidden_layers=2, max_position_embeddings=window, rope_theta=10000.0, **SHAPE)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().to(dtype)


@torch.inference_mode()
def profiled(model, ids, decode: bool, steps: int):
    """The profile of one prefill of `ids`, or of `steps` decode steps after it, after the same run
    untimed: the allocator then reuses memory it has touched (glibc serves large blocks from fresh
    pages until a first one is freed, which would charge the first variant's growing cache alone)."""
    if not decode:
        model(ids, logits_to_keep=1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(ids, logits_to_keep=1)
        return prof
    for timed in (False, True):
        cache = DynamicCache(config=model.config)
        token = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        with profile(activities=[ProfilerActivity.CPU]) if timed else contextlib.nullcontext() as prof:
            for _ in range(steps):
                token = model(token, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    return prof


@torch.inference_mode()
def timed(models: dict, ids, repeats: int) -> dict:
    """{label: [CPU seconds of each prefill]}, the models in turn in every repeat."""
    for model in models.values():
        model(ids, logits_to_keep=1)
    seconds = {label: [] for label in models}
    for _ in range(repeats):
        for label, model in models.items():
            start = time.process_time()
            model(ids, logits_to_keep=1)
            seconds[label].append(time.process_time() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--methods", nargs="+", required=True, help="METHOD or METHOD:KEY=VALUE[,KEY=VALUE], as rope-ext compare takes them"
    )
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--decode", action="store_true", help="profile decode steps after the prompt, not its prefill")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=12, help="ops listed per table")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--time", type=int, metavar="R", help="time R prefills of each in turn instead of profiling")
    args = parser.parse_args()
    if args.length <= args.window or args.steps < 1 or (args.time is not None and args.time < 1):
        parser.error("--length must be past --window, and --steps and --time at least 1")
    if args.time and args.decode:
        parser.error("--time times prefills: leave out --decode")
    try:
        specs = parse_specs(args.methods, [])
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(1)
    ids = torch.randint(1024, (1, args.length), generator=torch.Generator().manual_seed(1))
    models = {}
    for label, method, params in [("plain", None, {}), *specs]:
        models[label] = random_llama(args.window, DTYPES[args.dtype])
        if method is not None:
            rope_ext.patch(models[label], method, factor=args.length / args.window, **params)
    if args.time:
        seconds = timed(models, ids, args.time)
        print(f"prefill of {args.length} tokens over a window of {args.window}, {args.dtype}, CPU seconds of {args.time} repeats")
        for label, runs in seconds.items():
            ratios = [run / plain for run, plain in zip(runs, seconds["plain"])]
            print(
                f"{label}: {' '.join(f'{run:.3f}' for run in runs)}; over plain: fastest {min(runs) / min(seconds['plain']):.2f}, "
                f"median {statistics.median(runs) / statistics.median(seconds['plain']):.2f}, "
                f"per repeat {min(ratios):.2f}-{max(ratios):.2f}"
            )
        return
    for label, model in models.items():
        prof = profiled(model, ids, args.decode, args.steps)
        print(f"\n{label}, {'decode' if args.decode else 'prefill'}, {args.length} tokens over a window of {args.window}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
