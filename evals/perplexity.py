"""Sliding-window perplexity of long documents at one or more lengths (`rope-ext eval ppl`).

The protocol is YaRN's (and most long-context papers'): for a window of W text tokens and a
stride S, windows start at tokens 0, S, 2S, ... and stop at the first one that reaches the end of
the document; each window scores only the tokens no earlier window scored. Without BOS the first
token of a window cannot be predicted inside it and is not scored; with BOS every window is fed
BOS + its W tokens (W + 1 positions) and its first token is predicted from BOS.

Two aggregates come out of the same pass: `ppl` = exp(total NLL / scored tokens), and
`yarn_ppl` = exp(mean over windows of the window's mean NLL), which is what YaRN's script reports
and what published tables use.

Why it is faster than the usual re-forward of every window (`reforward_perplexity`, the reference
it is tested and benchmarked against), with the same numbers:
- only the scored tokens go through the LM head and the loss, in chunks, so fp32 logits for
  [W, vocab] never exist at once (the reference computes, upcasts and softmaxes all W rows);
- windows of several lengths that start at the same token share one forward. In a causal model a
  token's output depends only on the tokens before it, so a shorter window is a prefix of the
  longest one. That holds for every static method and for dynamic methods with the causal
  schedule; with `causal=False` (transformers' dynamic NTK) the scaling depends on how long the
  forward is, so there each window gets its own forward.
Reusing a KV cache *across* windows is not exact for any method: the tokens a window starts with
were computed, in the previous window, with more context than this window gives them.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from rope_ext import loading
from rope_ext.chunked import chunked_forward, token_nll

from . import data as data_mod
from . import measured, output


@dataclass(frozen=True)
class Window:
    """Text tokens [begin, end) of a document go through the model; [first, end) are scored."""

    begin: int
    end: int
    first: int


def plan_windows(n_tokens: int, length: int, stride: int, bos: bool) -> list[Window]:
    """The windows of one document (see the module docstring for the protocol)."""
    if length < (1 if bos else 2):
        raise ValueError(f"window length must be >= {1 if bos else 2} tokens, got {length}")
    if not 1 <= stride <= length:
        raise ValueError(f"stride must be between 1 and the window length {length}, got {stride}")
    windows, scored_until = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + length, n_tokens)
        first = max(scored_until, begin + (0 if bos else 1))
        if first < end:
            windows.append(Window(begin, end, first))
        scored_until = end
        if end == n_tokens:
            break
    return windows


def prefix_consistent(model) -> bool:
    """Whether each token's output depends only on the tokens before it, not on the length of
    the forward it is part of (what makes one forward serve several window lengths)."""
    applied = loading.patched(model)
    if applied is not None:
        return bool(applied.params.get("causal", True))
    rope = getattr(model.config, "rope_parameters", None) or {}
    return "dynamic" not in str(rope.get("rope_type", ""))


class TokenScorer:
    """Hidden states from the model body; NLL from the LM head on chosen rows only, in chunks
    (rope_ext.chunked.token_nll)."""

    def __init__(self, model):
        if model.get_output_embeddings() is None:
            raise ValueError(f"{type(model).__name__} exposes no output embeddings (LM head) to score tokens with")
        self.model = model
        self.decoder = model.get_decoder()
        self.device = model.get_output_embeddings().weight.device

    def hidden(self, ids: torch.Tensor, advance=None) -> torch.Tensor:
        """Final hidden states [T, H] for one sequence of token ids [T]. `advance(tokens)` is
        called as each decoder layer finishes, with its share of the T tokens, so a progress bar
        moves during one long forward."""
        layers = list(getattr(self.decoder, "layers", ())) if advance is not None else []
        shares = [len(ids) * (k + 1) // len(layers) - len(ids) * k // len(layers) for k in range(len(layers))]

        def after_layer(n):
            def hook(module, args, output) -> None:  # a hook that returns a value replaces the layer's output
                advance(n)

            return hook

        hooks = [layer.register_forward_hook(after_layer(n)) for layer, n in zip(layers, shares)]
        try:
            out = self.decoder(input_ids=ids[None].to(self.device), use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        if advance is not None and not layers:
            advance(len(ids))
        return out.last_hidden_state[0]

    def nll(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """-log p(target) for each row, float64 on the CPU."""
        return token_nll(self.model, hidden, targets)

    def scored(self, ids: torch.Tensor, rows: torch.Tensor, chunk_size: int | None, advance) -> torch.Tensor:
        """-log p(ids[r + 1]) for each of the sorted `rows` of one forward over ids [T]: in one
        forward, or `chunk_size` tokens at a time through the KV cache (rope_ext.chunked), each
        chunk's rows scored and its hidden states let go. `advance(tokens)` reports progress."""
        if chunk_size is None:
            hidden = self.hidden(ids, advance)
            return self.nll(hidden[rows.to(hidden.device)], ids[rows + 1])
        parts = []

        def score(start: int, hidden: torch.Tensor) -> None:
            mine = rows[(rows >= start) & (rows < start + hidden.shape[1])]
            parts.append(self.nll(hidden[0, (mine - start).to(hidden.device)], ids[mine + 1]))
            advance(hidden.shape[1])

        chunked_forward(self.model, ids, chunk_size, keep_hidden=False, on_chunk=score)
        return torch.cat(parts)


@dataclass
class LengthStats:
    """Accumulated NLL for one window length, overall, per window and per position bucket."""

    length: int
    bucket: int
    nll: float = 0.0
    tokens: int = 0
    window_losses: list = field(default_factory=list)
    bucket_nll: dict = field(default_factory=lambda: defaultdict(float))
    bucket_tokens: dict = field(default_factory=lambda: defaultdict(int))
    max_positions: int = 0
    documents: set = field(default_factory=set)

    def add(self, document: str, nll: torch.Tensor, positions: torch.Tensor, window_positions: int) -> None:
        self.nll += float(nll.sum())
        self.tokens += nll.numel()
        self.window_losses.append(float(nll.mean()))
        self.max_positions = max(self.max_positions, window_positions)
        self.documents.add(document)
        index = torch.div(positions, self.bucket, rounding_mode="floor")
        for b in torch.unique(index).tolist():
            chosen = index == b
            self.bucket_nll[b] += float(nll[chosen].sum())
            self.bucket_tokens[b] += int(chosen.sum())

    def summary(self) -> dict:
        buckets = [
            {
                "start": b * self.bucket,
                "end": (b + 1) * self.bucket,
                "tokens": self.bucket_tokens[b],
                "ppl": math.exp(self.bucket_nll[b] / self.bucket_tokens[b]),
            }
            for b in sorted(self.bucket_tokens)
        ]
        return {
            "length": self.length,
            "ppl": math.exp(self.nll / self.tokens) if self.tokens else None,
            "nll": self.nll / self.tokens if self.tokens else None,
            "yarn_ppl": math.exp(sum(self.window_losses) / len(self.window_losses)) if self.window_losses else None,
            "tokens": self.tokens,
            "windows": len(self.window_losses),
            "documents": len(self.documents),
            "max_positions": self.max_positions,
            "buckets": buckets,
        }


def bos_token(tokenizer, bos: bool | None) -> tuple[bool, int | None]:
    """(use BOS, its id). None means: do what the tokenizer does by default."""
    bos_id = tokenizer.bos_token_id
    if bos is None:
        probe = tokenizer("a")["input_ids"]
        bos = bos_id is not None and len(probe) > 0 and probe[0] == bos_id
    if bos and bos_id is None:
        raise ValueError("--bos: this tokenizer has no BOS token")
    return bos, bos_id


@torch.inference_mode()
def evaluate(
    model,
    documents,
    lengths,
    *,
    stride: int | None = None,
    bos: bool = False,
    bos_id: int | None = None,
    truncate: bool = False,
    bucket: int | None = None,
    share: bool | None = None,
    chunk_size: int | None = None,
    progress: bool = True,
) -> dict:
    """{length: summary dict} (see LengthStats.summary) for each window length.

    stride: tokens between window starts (default: the length itself, non-overlapping windows).
    truncate: cut each document to its first `length` tokens, one window per document, as YaRN's
        --truncate and docs/references.md, "Reference measurements on SmolLM2-135M" do.
    bucket: width of the position buckets (default: max length / 8).
    share: let windows that start together share a forward (default: when exact, see
        prefix_consistent).
    chunk_size: run each forward through the KV cache this many tokens at a time
        (rope_ext.chunked; bounded memory, the same numbers to rounding); None: one forward."""
    lengths = sorted(set(int(n) for n in lengths))
    if not lengths:
        raise ValueError("give at least one length")
    if not documents:
        raise ValueError("no documents to evaluate")
    if bos and bos_id is None:
        raise ValueError("bos=True needs bos_id")
    bucket = bucket or max(1, (lengths[-1] + int(bos)) // 8)
    if share is None:
        share = prefix_consistent(model)
    offset = 1 if bos else 0
    scorer = TokenScorer(model)
    stats = {n: LengthStats(n, bucket) for n in lengths}

    jobs = []  # (document, begin, [(length, window)]): one forward each
    for doc in documents:
        starting = defaultdict(list)
        for n in lengths:
            size = min(len(doc), n) if truncate else len(doc)
            for w in plan_windows(size, n, stride or n, bos):
                starting[w.begin].append((n, w))
        for begin in sorted(starting):
            group = starting[begin]
            jobs.extend([(doc, begin, group)] if share else [(doc, begin, [item]) for item in group])

    total = sum(max(w.end for _, w in group) - begin + offset for _, begin, group in jobs)
    bar = tqdm(total=total, unit="tok", desc="perplexity", disable=not progress, file=sys.stderr)
    for doc, begin, group in jobs:
        end = max(w.end for _, w in group)
        ids = doc.ids[begin:end]
        if bos:
            ids = torch.cat((torch.tensor([bos_id]), ids))
        # row r of the forward predicts ids[r + 1]; score each needed row once
        needed = torch.zeros(len(ids), dtype=torch.bool)
        for _, w in group:
            needed[w.first - begin + offset - 1 : w.end - begin + offset - 1] = True
        rows = needed.nonzero().squeeze(1)
        nll = scorer.scored(ids, rows, chunk_size, bar.update)
        where = torch.full((len(ids),), -1, dtype=torch.long)
        where[rows] = torch.arange(len(rows))
        for n, w in group:
            r = torch.arange(w.first - begin + offset - 1, w.end - begin + offset - 1)
            stats[n].add(doc.name, nll[where[r]], positions=r + 1, window_positions=w.end - begin + offset)
    bar.close()
    return {n: s.summary() for n, s in stats.items()}


@torch.inference_mode()
def reforward_perplexity(
    model, documents, length: int, stride: int, *, bos: bool = False, bos_id: int | None = None, progress: bool = True
) -> dict:
    """The protocol of YaRN's eval/perplexity.py as written: per window, a full forward with
    `labels` (earlier-scored tokens set to -100) and the model's own loss. The reference that
    `evaluate` must agree with, and the baseline bench/eval_speed.py times."""
    losses, nll_sum, count = [], 0.0, 0
    device = model.get_output_embeddings().weight.device
    for doc in tqdm(documents, desc="re-forward", disable=not progress, file=sys.stderr):
        tokens = doc.ids
        previous_end = 0
        for begin in range(0, len(tokens), stride):
            end = min(begin + length, len(tokens))
            target_len = end - previous_end
            inputs = tokens[begin:end]
            if bos:
                inputs = torch.cat((torch.tensor([bos_id]), inputs))
            targets = inputs.clone()
            targets[:-target_len] = -100
            loss = model(input_ids=inputs[None].to(device), labels=targets[None].to(device), use_cache=False).loss
            scored = int((targets[1:] != -100).sum())
            losses.append(float(loss))
            nll_sum += float(loss) * scored
            count += scored
            previous_end = end
            if end == len(tokens):
                break
    return {
        "length": length,
        "ppl": math.exp(nll_sum / count),
        "yarn_ppl": math.exp(sum(losses) / len(losses)),
        "tokens": count,
        "windows": len(losses),
    }


def markdown(results: dict, setup: dict) -> str:
    """The per-length table and the per-bucket table."""
    lengths = sorted(results)
    lines = [
        f"# Perplexity: {setup['model']} ({setup['method']}" + (f" x{setup['factor']:g}" if setup.get("factor") else "") + ")\n",
        f"Data: {setup['data']}; stride: {setup['stride'] or 'the length'}; BOS per window: {setup['bos']}; "
        f"truncate: {setup['truncate']}; model capacity: {setup['capacity']} positions ({setup['capacity_note']}).\n",
    ]
    rows = [
        [n, results[n]["documents"], results[n]["windows"], results[n]["tokens"], results[n]["ppl"], results[n]["yarn_ppl"]]
        for n in lengths
    ]
    lines.append(
        output.markdown_table(
            ["length", "documents", "windows", "scored tokens", "PPL (token-weighted)", "PPL (YaRN: mean of window losses)"], rows
        )
    )
    starts = sorted({b["start"] for n in lengths for b in results[n]["buckets"]})
    if starts:
        width = results[lengths[0]]["buckets"][0]["end"] - results[lengths[0]]["buckets"][0]["start"]
        header = ["length"] + [f"{s}-{s + width}" for s in starts]
        table = []
        for n in lengths:
            by_start = {b["start"]: b["ppl"] for b in results[n]["buckets"]}
            table.append([n] + [by_start.get(s) for s in starts])
        lines.append("\nPPL by position of the scored token in its window:\n")
        lines.append(output.markdown_table(header, table))
    return "\n".join(lines)


def check_windows(lengths: list[int] | None, stride: int | None, bucket: int | None) -> None:
    """--lengths, --stride and --bucket, before anything loads (`lengths` None: they follow from
    the model, and the stride is held against them once it is known)."""
    if lengths is not None and any(n < 2 for n in lengths):
        raise ValueError(f"--lengths must be >= 2 tokens, got {lengths}")
    longest_stride = min(lengths) if lengths else None
    if stride is not None and (stride < 1 or longest_stride is not None and stride > longest_stride):
        raise ValueError(
            f"--stride must be between 1 and the shortest length {longest_stride or 'of --lengths'} "
            f"(a larger one skips tokens), got {stride}"
        )
    if bucket is not None and bucket < 1:
        raise ValueError(f"--bucket must be >= 1 token, got {bucket}")


def check(args: argparse.Namespace):
    """(method parameters, texts, result folder): every argument checked before the model loads."""
    check_windows(args.lengths, args.stride, args.bucket)
    params = loading.check_model_args(args)
    texts = data_mod.texts_from_args(args)
    return params, texts, output.ResultFolder(args.output, "ppl", ["ppl.json", "ppl.md", "ppl.png"], args.overwrite).claim()


def run(args: argparse.Namespace, plan) -> int:
    params, texts, out = plan
    model, tokenizer, info = loading.model_from_args(args, params)
    documents = data_mod.documents_from_args(args, texts, tokenizer)
    bos, bos_id = bos_token(tokenizer, args.bos)
    for n in sorted(args.lengths):
        measured.warn_beyond_capacity(model, n + int(bos), f"length {n}")
    longest_doc = max(len(d) for d in documents)
    for n in args.lengths:
        if n > longest_doc:
            print(
                f"rope-ext: no document reaches {n} tokens (longest: {longest_doc}); "
                f"the PPL at {n} covers shorter contexts only (see max_positions)",
                file=sys.stderr,
            )
    record = output.provenance(model, args.model)
    started = time.perf_counter()
    results = evaluate(
        model,
        documents,
        args.lengths,
        stride=args.stride,
        bos=bos,
        bos_id=bos_id,
        truncate=args.truncate,
        bucket=args.bucket,
        chunk_size=args.chunk_size,
        progress=not args.no_progress,
    )
    setup = {
        **measured.describe_setup(model, info, args.method, params, args.chunk_size),
        "data": args.data,
        "documents": len(documents),
        "document_tokens": sum(len(d) for d in documents),
        "stride": args.stride,
        "bos": bos,
        "truncate": args.truncate,
        "seconds": round(time.perf_counter() - started, 2),
    }
    out.write_json("ppl.json", {"setup": setup, "lengths": {str(n): r for n, r in results.items()}, "provenance": record})
    text = markdown(results, setup) + "\n" + output.provenance_line(record)
    out.write_text("ppl.md", text)
    from .plots import bucket_plot, model_name

    label = setup["method"] + (f" x{setup['factor']:g}" if setup["factor"] else "")
    out.save_figure(
        "ppl.png",
        bucket_plot(
            results,
            title=f"{model_name(setup['model'])}, {label}: PPL by position",
            window=setup["patch"]["original_window"] if setup["patch"] else setup["capacity"],
        ),
    )
    print(text)
    print(f"results in {out.folder}")
    return 0
