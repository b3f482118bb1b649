"""Where a patched forward spends its time: torch.profiler's table of the ops of one prefill (or of
decode steps) on a 2-layer random Llama of SmolLM2-135M's attention and MLP shapes (576 hidden, 9
query heads on 3 key/value heads of 64, 1536 MLP), fp32, one thread, plain and each --methods.

A 2-layer model keeps the attention-side work visible beside the linear layers: it is the proxy for
what a patch adds per layer, which a GPU with many layers shows again once launches dominate. The
prompt is --length tokens over a trained window of --window (8x by default); --decode profiles
--steps greedy steps after that prompt instead of the prefill. Each table lists the ops by their
own CPU time, the total at its foot.

    python bench/attention_profile.py --methods dynamic                      # prefill, 4096 over 512
    python bench/attention_profile.py --methods self_extend sink_window --decode --length 2048
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import rope_ext
from rope_ext.evals.compare import parse_specs

# SmolLM2-135M's config.json (HuggingFaceTB/SmolLM2-135M) for these fields, two of its 30 layers
SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}


def random_llama(window: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=1024, num_hidden_layers=2, max_position_embeddings=window, rope_theta=10000.0, **SHAPE)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


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
    args = parser.parse_args()
    if args.length <= args.window or args.steps < 1:
        parser.error("--length must be past --window, and --steps at least 1")
    try:
        specs = parse_specs(args.methods, [])
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(1)
    ids = torch.randint(1024, (1, args.length), generator=torch.Generator().manual_seed(1))
    for label, method, params in [("plain", None, {}), *specs]:
        model = random_llama(args.window)
        if method is not None:
            rope_ext.patch(model, method, factor=args.length / args.window, **params)
        prof = profiled(model, ids, args.decode, args.steps)
        print(f"\n{label}, {'decode' if args.decode else 'prefill'}, {args.length} tokens over a window of {args.window}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
