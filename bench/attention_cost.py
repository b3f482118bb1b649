"""Cost of the attention-side methods against plain attention, side by side in one run on the
embedded SmolLM2, and the agreement of self_extend with its one-softmax formulation.

1. Forward time of the decoder at --length tokens (default 16384, 2x the window): the unpatched
   model, self_extend x4 and dca x4. Variants are interleaved, so machine noise hits all of them;
   the ratio of the fastest runs is the estimate, the ratio of the medians is printed beside it.
2. self_extend as it runs (attention calls of the model's head size, merged by log-sum-exp)
   against the one-softmax formulation it replaced (one call on doubled head dims: queries
   [q_own, q_grouped], keys [k_own, 0] and [0, k_grouped]), which `OneSoftmax` below keeps as
   the reference: forward time, and max |delta logit| over every position in fp32.
3. With --fp64: each variant once more in fp64 (angles stay fp32, as in every dtype), and each fp32
   variant's max |delta logit| against its own fp64 run: the fp32 rounding of each way to compute
   attention, which tells whether item 2's difference is rounding or a different function.

    python bench/attention_cost.py              # ~15 min on 2 CPU cores
    python bench/attention_cost.py --length 4096 --repeats 1   # a quick look
    python bench/attention_cost.py --repeats 1 --fp64          # ~40 min
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

import rope_ext
from rope_ext.attention import AttentionChain, Rotator
from rope_ext.defaults import gutenberg_text, load_smollm2
from rope_ext.evals.output import provenance, write_measurement
from rope_ext.attention import SCORE_BYTES
from rope_ext.method.attention_side import TwoPartAttention
from rope_ext.rotation import rotate_prepared

FACTOR = 4.0
HEAD_ROWS = 1024  # positions sent through the LM head at a time when comparing logits


class OneSoftmax(TwoPartAttention):
    """self_extend's grouped rows as one backend call on doubled head dims: a dot product of
    [q_own, q_grouped] with [k_own, 0] or [0, k_grouped] picks one pair of positions."""

    def __call__(self, module, query, key, value, attention_mask, attend, **kwargs):
        rotator = self.rotator
        frame = rotator.frame
        kv_len, q_len = key.shape[-2], query.shape[-2]
        k_pos = frame.k_pos[..., -kv_len:]
        group, window = rotator.params["group"], rotator.params["window"]
        trained = rotator.geometry.original_window
        inv_freq, scale = frame.angles(trained)

        def rotated(x, name, at):
            factors = rotator.per_forward((name, x.dtype), lambda: rotator.factors([at], inv_freq, scale, x.dtype))
            return rotate_prepared(x.unsqueeze(2), *factors, *rotator.pairing)[:, :, 0]

        q_own, k_own = rotated(query, "q own", frame.q_pos), rotated(key, "k own", k_pos)
        extended = frame.lengths > trained
        first = int(extended.any(0).nonzero()[0])  # the bench's input always goes past the window
        q_group = rotated(query, "q grouped", torch.div(frame.q_pos, group, rounding_mode="floor") + (window - window // group))
        k_group = rotated(key, "k grouped", torch.div(k_pos, group, rounding_mode="floor"))
        queries = torch.cat((q_own, q_group), dim=-1)
        neighbours = torch.cat((k_own, torch.zeros_like(k_group)), dim=-1)
        distant = torch.cat((torch.zeros_like(k_own), k_group), dim=-1)
        kwargs["scaling"] = kwargs.get("scaling") or query.shape[-1] ** -0.5
        outputs = [attend(module, q_own[:, :, :first], k_own[:, :, :first], value[:, :, :first], None, **kwargs)[0]]
        rows = max(1, SCORE_BYTES // (query.shape[0] * query.shape[1] * (kv_len + window) * 4))
        for lo in range(first, q_len, rows):
            hi = min(lo + rows, q_len)
            q_index = torch.arange(lo, hi)
            far_end, near_lo = max(0, hi - window), max(0, lo - window + 1)
            far_ok = (q_index[:, None] - torch.arange(far_end)[None, :]) >= window
            distance = q_index[:, None] - torch.arange(near_lo, hi)[None, :]
            allowed = torch.cat((far_ok, (distance >= 0) & (distance < window)), dim=-1)[None, None]
            keys = torch.cat((distant[:, :, :far_end], neighbours[:, :, near_lo:hi]), dim=-2)
            values = torch.cat((value[:, :, :far_end], value[:, :, near_lo:hi]), dim=-2)
            values = torch.cat((values, torch.zeros_like(values)), dim=-1)  # fused kernels need one head size
            out, _ = attend(module, queries[:, :, lo:hi], keys, values, self._additive(allowed, None, query.dtype), **kwargs)
            outputs.append(out[..., : value.shape[-1]])
        return torch.cat(outputs, dim=1), None


def one_softmax_variant(model):
    """A copy of `model` patched with self_extend, attending through OneSoftmax."""
    variant = copy.deepcopy(model)
    rope_ext.patch(variant, "self_extend", factor=FACTOR)
    chain = AttentionChain([OneSoftmax(Rotator(variant.model.rotary_emb))])
    for layer in variant.model.layers:
        layer.self_attn.rope_ext_attention = chain
    return variant


def patched(model, method: str):
    variant = copy.deepcopy(model)
    rope_ext.patch(variant, method, factor=FACTOR)
    return variant


@torch.inference_mode()
def forward(model, ids) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    hidden = model.model(ids).last_hidden_state
    return time.perf_counter() - start, hidden


@torch.inference_mode()
def max_logit_difference(model, a: torch.Tensor, b: torch.Tensor, model_b=None) -> float:
    """max |logits(a) - logits(b)| over every position, hidden states a through `model`'s LM head and
    b through `model_b`'s (default: the same), compared in the wider of the two dtypes."""
    head_a, head_b = model.get_output_embeddings(), (model_b or model).get_output_embeddings()
    return max(
        (head_a(a[:, i : i + HEAD_ROWS]).double() - head_b(b[:, i : i + HEAD_ROWS]).double()).abs().max().item()
        for i in range(0, a.shape[1], HEAD_ROWS)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--fp64", action="store_true", help="also run each variant in fp64 and compare its fp32 logits with them")
    parser.add_argument(
        "--out", type=Path, default=Path(f"rope-ext-results/bench-attention-{time.strftime('%Y%m%d-%H%M%S')}.json")
    )
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose another --out")

    model, tokenizer = load_smollm2()
    ids = tokenizer(gutenberg_text(), return_tensors="pt").input_ids[:, : args.length]
    variants = {
        "plain": model,
        "self_extend": patched(model, "self_extend"),
        "dca": patched(model, "dca"),
        "self_extend, one softmax": one_softmax_variant(model),
    }
    seconds = {name: [] for name in variants}
    hidden = {}
    for _ in tqdm(range(args.repeats), desc=f"forward x{args.length}"):
        for name, variant in variants.items():
            took, hidden[name] = forward(variant, ids)
            seconds[name].append(took)
    plain = seconds["plain"]
    results = {
        "length": args.length,
        "repeats": args.repeats,
        "provenance": provenance(model, None),
        "forward_s": seconds,
        "ratio_to_plain": {name: min(s) / min(plain) for name, s in seconds.items()},
        "median_ratio_to_plain": {name: statistics.median(s) / statistics.median(plain) for name, s in seconds.items()},
        "self_extend_max_abs_logit_difference": max_logit_difference(
            model, hidden["self_extend"], hidden["self_extend, one softmax"]
        ),
    }
    print(f"\nDecoder forward at {args.length} tokens, fastest of {args.repeats} (torch threads: {torch.get_num_threads()})")
    print("| variant | s | / plain | / plain, medians |\n|---|---|---|---|")
    for name, s in seconds.items():
        print(f"| {name} | {min(s):.1f} | {results['ratio_to_plain'][name]:.3f} | {results['median_ratio_to_plain'][name]:.3f} |")
    print(
        f"\nself_extend vs its one-softmax formulation: max |delta logit| = {results['self_extend_max_abs_logit_difference']:.2e} (fp32)"
    )
    if args.fp64:
        rounding = {}
        for name, variant in tqdm(variants.items(), desc=f"fp64 x{args.length}"):
            twin = copy.deepcopy(variant).double()
            _, exact = forward(twin, ids)
            rounding[name] = max_logit_difference(variant, hidden[name], exact, twin)
            del twin, exact
        results["fp32_max_abs_logit_difference_to_fp64"] = rounding
        print("\nfp32 against the same variant in fp64: max |delta logit|\n| variant | max abs |\n|---|---|")
        for name, value in rounding.items():
            print(f"| {name} | {value:.2e} |")
    write_measurement(args.out, results)


if __name__ == "__main__":
    main()
