"""Where a query's attention goes, per layer and head, under any patch: the share of its softmax
on given spans of the keys (the passkey's key line, the question, the filler in bins).

Attention is linear in the values, and so are rope-ext's two-part merges (a softmax-weighted sum of
parts over disjoint keys). So an attention call given, instead of the values, indicators of the
spans (channel c is 1 on span c's keys, 0 elsewhere) returns in channel c each head's attention
mass on span c, whatever positions the method gives the query and the keys. The probe makes that
second call beside the true one, on the last query row of the forwards it watches; the true call's
output is what the model goes on with, so its logits are unchanged (asserted in the tests). Under
a patch the probed forward is one token (a decode step after a cached prefill): an attention-side
method places a lone query row by the keys it follows.

`python -m rope_ext.evals.attention_mass --method M --factor F --length N --depths D ...` runs the
passkey prompts of those depths (the deepest prefilled whole, the others from its cache cut at
their own key, as `rope-ext eval passkey --share-prefix` does) and writes, per prompt, the answer
and the first answer token's attention mass per layer and head on the prompt's parts: the task
line, the filler before the key, the key line, the key's first digits, the filler after it, the
question, the last `--near` keys, and the filler in `--bins` equal bins of the prompt."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

CHUNK = 8192  # prefill chunk: bounds the mask sdpa builds for a rest that follows cached keys


def passkey_spans(tokenizer, prompt, near: int, bins: int) -> dict[str, tuple[int, int]]:
    """{part: [start, end) token range} of a passkey prompt (rope_ext.evals.passkey.Prompt)."""
    from .passkey import KEY_LINE, QUESTION, TASK

    offsets = tokenizer(prompt.text, return_offsets_mapping=True, verbose=False)["offset_mapping"]
    shift = len(prompt.ids) - len(offsets)  # special tokens the tokenizer adds in front

    def tokens(start_char: int, end_char: int) -> tuple[int, int]:
        inside = [i for i, (a, b) in enumerate(offsets) if b > start_char and a < end_char]
        return inside[0] + shift, inside[-1] + 1 + shift

    key_line = KEY_LINE.format(key=prompt.key)
    at = prompt.text.index(key_line)
    digits = prompt.text.index(str(prompt.key), at)
    question = prompt.text.rindex(QUESTION)
    n = len(prompt.ids)
    line, task = tokens(at, at + len(key_line)), tokens(0, len(TASK))
    parts = {
        "task": task,
        "filler before": (task[1], line[0]),
        "key line": line,
        "key digits": tokens(digits, digits + len(str(prompt.key))),
        "filler after": (line[1], tokens(question, len(prompt.text))[0]),
        "question": tokens(question, len(prompt.text)),
        f"last {near}": (max(0, n - near), n),
    }
    edges = [round(n * b / bins) for b in range(bins + 1)]
    return parts | {f"bin {b}": (edges[b], edges[b + 1]) for b in range(bins)}


def indicators(value: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Values of `value`'s shape [batch, kv heads, keys, dim]: channel c is 1 on the keys
    [start, end) of spans[c], 0 elsewhere."""
    if len(spans) > value.shape[-1]:
        raise ValueError(f"{len(spans)} spans, but a head's values have {value.shape[-1]} channels")
    marked = torch.zeros_like(value)
    for channel, (start, end) in enumerate(spans):
        marked[:, :, start:end, channel] = 1
    return marked


@contextmanager
def mass_probe(model, spans: list[tuple[int, int]]):
    """While open, every attention call of `model` also measures its last query row's attention
    mass on `spans` (key index ranges): yields {layer index: tensor [query heads, len(spans)]}, the
    last forward's, in fp32."""
    name = model.config._attn_implementation
    # transformers calls a model file's own eager function by its module-level name, every other
    # backend through the registry
    owner, key = (sys.modules[type(model).__module__], "eager_attention_forward") if name == "eager" else (None, name)
    attend = getattr(owner, key) if owner else ALL_ATTENTION_FUNCTIONS[key]
    found: dict[int, torch.Tensor] = {}

    patched = getattr(model.config, "rope_ext", None) is not None

    def probed(module, query, key, value, attention_mask, *args, **kwargs):
        if patched and query.shape[2] > 1:
            raise ValueError(
                "mass_probe: under a patch, probe a one-token forward: prefill the prompt through the cache and "
                "run its last token alone"
            )
        out = attend(module, query, key, value, attention_mask, *args, **kwargs)
        marked = attend(module, query[:, :, -1:], key, indicators(value, spans), _last_row(attention_mask), *args, **kwargs)
        found[module.layer_idx] = marked[0][0, -1, :, : len(spans)].float()  # [batch, rows, heads, dim]
        return out

    def install(function) -> None:
        if owner:
            setattr(owner, key, function)
        else:
            ALL_ATTENTION_FUNCTIONS[key] = function

    install(probed)
    try:
        yield found
    finally:
        install(attend)


def _last_row(mask):
    return mask if mask is None or mask.dim() < 4 else mask[:, :, -1:]


def run_prompts(model, tokenizer, length: int, depths, seed: int, near: int, bins: int, new_tokens: int) -> list[dict]:
    """One record per depth: the prompt's parts, the greedy answer, and the masses
    {part: [layer][head]} of the last prompt token's query (the one that answers)."""
    from .passkey import build_prompt, first_integer, prefill, trial_key

    kept, records = None, []
    for depth in sorted(depths, reverse=True):  # the deepest key first: the others share its filler
        prompt = build_prompt(tokenizer, length, depth, trial_key(seed, length, depth, 0))
        head = prompt.ids[:-1]
        kept = kept or (head, prefill(model, head, chunk_size=CHUNK))
        cache = prefill(model, head, kept, CHUNK)
        spans = passkey_spans(tokenizer, prompt, near, bins)
        with torch.no_grad():
            with mass_probe(model, list(spans.values())) as found:
                logits = model(torch.tensor([prompt.ids[-1:]]), cache=cache, use_cache=True).logits[0, -1]
            answer = [int(logits.argmax())]
            for _ in range(new_tokens - 1):
                logits = model(torch.tensor([answer[-1:]]), cache=cache, use_cache=True).logits[0, -1]
                answer.append(int(logits.argmax()))
        text = tokenizer.decode(answer, skip_special_tokens=True)
        masses = torch.stack([found[layer] for layer in sorted(found)])  # [layers, heads, parts]
        records.append(
            {
                "depth": depth,
                "seed": seed,
                "key": prompt.key,
                "prompt_tokens": len(prompt.ids),
                "answer": text,
                "correct": first_integer(text) == prompt.key,
                "spans": spans,
                "mass": {part: masses[:, :, c].tolist() for c, part in enumerate(spans)},
            }
        )
        del cache
    return records


def main(argv=None) -> int:
    import argparse
    import json
    import time

    from rope_ext import loading

    from . import measured, output

    parser = argparse.ArgumentParser(prog="python -m rope_ext.evals.attention_mass", description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, required=True, help="prompt length in tokens")
    parser.add_argument("--depths", type=float, nargs="+", required=True, help="key depths, one prompt each")
    parser.add_argument("--seed", type=int, default=0, help="seed of the keys (rope-ext eval passkey's)")
    parser.add_argument("--near", type=int, default=2048, help="the last keys counted as one part (default 2048)")
    parser.add_argument("--bins", type=int, default=32, help="equal bins of the prompt (default 32)")
    parser.add_argument("--max-new-tokens", type=int, default=10)
    parser.add_argument("--output", required=True, help="the JSON file to write")
    loading.model_arguments(parser)
    args = parser.parse_args(argv)
    params = loading.check_model_args(args)
    model, tokenizer, info = loading.model_from_args(args, params)
    started = time.perf_counter()
    records = run_prompts(model, tokenizer, args.length, args.depths, args.seed, args.near, args.bins, args.max_new_tokens)
    setup = {
        **measured.describe_setup(model, info, args.method, params),
        "length": args.length,
        "seed": args.seed,
        "seconds": round(time.perf_counter() - started, 1),
    }
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(output.clean_json({"setup": setup, "prompts": records, "provenance": output.provenance(model, args.model)}), f)
    for r in records:
        line = torch.tensor(r["mass"]["key line"])  # [layers, heads]
        print(
            f"depth {r['depth']:g}: {'correct' if r['correct'] else 'missed'} ({r['answer']!r}); key-line mass, "
            f"largest head per layer: {' '.join(f'{v:.2f}' for v in line.max(-1).values.tolist())}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
