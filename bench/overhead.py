"""Cost of a rope-ext patch, measured side by side in one run on the embedded SmolLM2.

1. Forward time at --length tokens: rope_ext.patch(model, m) vs the same weights built by
   transformers from the native config, for every method transformers also has. Variants are
   interleaved, so machine noise hits both sides; the ratio of the fastest runs is the estimate
   (load only ever adds time), the ratio of the medians is printed beside it.
2. Decode cost of the KV-cache fix for dynamic NTK: tokens/s of greedy decoding after a
   --decode-context prefill, past the window, for plain RoPE, transformers' `dynamic` (fast but
   inconsistent with a full forward) and rope-ext `dynamic` (consistent) at granularity 1 and 64.
   To be past the window without a 9k-token prefill, every decode variant uses a window of
   --decode-context // 2 (`original_window=` for rope-ext, max_position_embeddings for transformers).

    python bench/overhead.py            # ~10 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, DynamicCache

import rope_ext
from rope_ext.defaults import gutenberg_text, load_smollm2
from rope_ext.evals.output import provenance, write_measurement

FACTOR = 4.0


def native_variant(model, rope_parameters: dict, max_position_embeddings: int):
    config = copy.deepcopy(model.config)
    config.rope_parameters = {"rope_theta": model.config.rope_parameters["rope_theta"], **rope_parameters}
    config.max_position_embeddings = max_position_embeddings
    native = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    native.load_state_dict(model.state_dict())
    return native


def patched_variant(model, method: str, **params):
    patched = copy.deepcopy(model)
    rope_ext.patch(patched, method, factor=FACTOR, **params)
    return patched


@torch.inference_mode()
def forward_seconds(model, ids) -> float:
    start = time.perf_counter()
    model.model(ids)  # the decoder only: the LM head is identical on both sides
    return time.perf_counter() - start


@torch.inference_mode()
def rotary_ms(model, length: int, calls: int = 50) -> float:
    """Fastest of `calls` forwards of the model's rotary module alone, the only module a static
    patch replaces (for dynamic methods the rotation moves into attention and this is not all)."""
    x = torch.zeros(1, length, model.config.hidden_size)
    positions = torch.arange(length)[None]
    rotary, best = model.model.rotary_emb, float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        rotary(x, positions)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


class Decoder:
    """Greedy decoding from a prefilled KV cache, timed in blocks of steps."""

    @torch.inference_mode()
    def __init__(self, model, ids):
        self.model, self.cache = model, DynamicCache(config=model.config)
        self.token = model(ids, cache=self.cache, use_cache=True).logits[:, -1:].argmax(-1)

    @torch.inference_mode()
    def seconds(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            self.token = self.model(self.token, cache=self.cache, use_cache=True).logits[:, -1:].argmax(-1)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=16, help="steps per timed decode block")
    parser.add_argument(
        "--out", type=Path, default=Path(f"rope-ext-results/bench-overhead-{time.strftime('%Y%m%d-%H%M%S')}.json")
    )
    args = parser.parse_args()

    model, tokenizer = load_smollm2()
    window = model.config.max_position_embeddings
    ids = tokenizer(gutenberg_text(), return_tensors="pt").input_ids[:, : max(args.length, args.decode_context + 1)]
    results: dict = {
        "torch_threads": torch.get_num_threads(),
        "length": args.length,
        "forward": {},
        "decode": {},
        "provenance": provenance(model, None),
    }

    pairs = {
        "linear": (patched_variant(model, "linear"), native_variant(model, {"rope_type": "linear", "factor": FACTOR}, window)),
        "dynamic (causal=False)": (
            patched_variant(model, "dynamic", causal=False),
            native_variant(model, {"rope_type": "dynamic", "factor": FACTOR}, window),
        ),
        "yarn": (
            patched_variant(model, "yarn"),
            native_variant(
                model, {"rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": window}, int(FACTOR * window)
            ),
        ),
        "llama3": (
            patched_variant(model, "llama3"),
            native_variant(
                model,
                {
                    "rope_type": "llama3",
                    "factor": FACTOR,
                    "original_max_position_embeddings": window,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                },
                int(FACTOR * window),
            ),
        ),
    }
    x = ids[:, : args.length]
    times = {name: ([], []) for name in pairs}
    for _ in tqdm(range(args.repeats), desc=f"forward x{args.length}"):
        for name, (patched, native) in pairs.items():
            times[name][0].append(forward_seconds(patched, x))
            times[name][1].append(forward_seconds(native, x))
    for name, (ours, theirs) in times.items():
        patched, native = pairs[name]
        results["forward"][name] = {
            "rope_ext_s": ours,
            "native_s": theirs,
            "ratio": min(ours) / min(theirs),
            "median_ratio": statistics.median(ours) / statistics.median(theirs),
            "rotary_ms": {"rope_ext": rotary_ms(patched, args.length), "native": rotary_ms(native, args.length)},
        }

    small = args.decode_context // 2
    decoders = {
        "plain RoPE": model,
        "transformers dynamic": native_variant(model, {"rope_type": "dynamic", "factor": FACTOR}, small),
        "rope-ext dynamic (granularity 1)": patched_variant(model, "dynamic", original_window=small),
        "rope-ext dynamic (granularity 64)": patched_variant(model, "dynamic", original_window=small, granularity=64),
    }
    prefix = ids[:, : args.decode_context]
    decoders = {name: Decoder(m, prefix) for name, m in tqdm(decoders.items(), desc=f"prefill {args.decode_context}")}
    blocks = {name: [] for name in decoders}
    for _ in tqdm(range(args.repeats), desc="decode"):
        for name, decoder in decoders.items():
            blocks[name].append(decoder.seconds(args.decode_steps))
    results["decode"] = {name: args.decode_steps / min(b) for name, b in blocks.items()}

    print(f"\nForward at {args.length} tokens, fastest of {args.repeats} (torch threads: {results['torch_threads']})")
    print(
        "| method | rope-ext s | transformers s | ratio | ratio of medians | rotary module ms, rope-ext / transformers |\n"
        "|---|---|---|---|---|---|"
    )
    for name, row in results["forward"].items():
        rot = row["rotary_ms"]
        print(
            f"| {name} | {min(row['rope_ext_s']):.2f} | {min(row['native_s']):.2f} | {row['ratio']:.3f} | "
            f"{row['median_ratio']:.3f} | {rot['rope_ext']:.2f} / {rot['native']:.2f} |"
        )
    plain = results["decode"]["plain RoPE"]
    print(
        f"\nGreedy decode after a {args.decode_context}-token prefill, window {small}: fastest of {args.repeats} "
        f"interleaved blocks of {args.decode_steps} steps"
    )
    print("| variant | tokens/s | vs plain |\n|---|---|---|")
    for name, rate in results["decode"].items():
        print(f"| {name} | {rate:.2f} | {rate / plain:.2f} |")
    write_measurement(args.out, results)


if __name__ == "__main__":
    main()
