"""Methods x lengths on one model (`rope-ext compare`): perplexity and passkey retrieval for each
method at each length, as one table (markdown + JSON) and one figure (PPL vs length and by position,
one line per method, the original window marked; passkey accuracy per method), and with
--ruler-samples the score of one of lm-eval's RULER tasks per method and length.

By default each document is cut to each length (one window per document, as YaRN's --truncate)
and one forward at the longest length serves every shorter one where that is exact (see
perplexity.py); --stride switches to sliding windows over whole documents.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from importlib import resources

import yaml

import rope_ext
from rope_ext import loading
from rope_ext.extras import require
from rope_ext.method.base import as_size, check_factor

from . import data as data_mod
from . import measured, output, passkey, perplexity

RULER_TASK = "niah_single_1"  # one needle in a repeated filler: no download (docs/evals.md, "Standard suites")
RULER_SAMPLES = 500  # what lm-eval's RULER tasks build per length


def default_methods() -> list[str]:
    return [loading.PLAIN, *rope_ext.methods()]


def parse_specs(specs: list[str], items: list[str]) -> list[tuple[str, str, dict]]:
    """Method specs and --param items -> [(label, method, params)].

    A spec is METHOD or METHOD:KEY=VALUE[,KEY=VALUE...], so one method can run with several
    settings (e.g. `dynamic:causal=false dynamic:granularity=4096`); the spec is its label.
    `--param METHOD:KEY=VALUE` adds to every spec of METHOD."""
    runs = []
    for spec in specs:
        method, _, rest = spec.partition(":")
        runs.append((spec, method, loading.parse_params(loading.split_items(f"--methods {spec}", rest)) if rest else {}))
    labels = [label for label, _, _ in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--methods lists a spec twice: {' '.join(labels)}")
    methods = {method for _, method, _ in runs}
    for item in items:
        method, sep, rest = item.partition(":")
        if not sep or method not in methods:
            raise ValueError(f"--param expects METHOD:KEY=VALUE with METHOD one of {', '.join(sorted(methods))}, got {item!r}")
        for _, m, params in runs:
            if m == method:
                params.update(loading.parse_params([rest]))
    return runs


def original_window(model) -> int:
    applied = loading.patched(model)
    if applied is not None:
        return applied.original_window
    return measured.capacity(model)[0]


def markdown(report: dict) -> str:
    setup, rows_in = report["setup"], report["methods"]
    lengths = setup["lengths"]
    pk = setup["passkey"] is not None
    pk_lengths = setup["passkey"]["lengths"] if pk else []
    ruler = setup["ruler"]
    ruler_lengths = ruler["lengths"] if ruler else []
    header = (
        ["method", "factor"]
        + [f"PPL @{n}" for n in lengths]
        + [f"passkey @{n}" for n in pk_lengths]
        + [f"{ruler['task']} @{n}" for n in ruler_lengths]
    )
    rows = []
    for m in rows_in:
        row = [m["label"], "-" if m["factor"] is None else f"{m['factor']:g}"]
        row += [m["ppl"][str(n)]["ppl"] for n in lengths]
        if pk:
            row += [m["passkey"]["by_length"].get(n) for n in pk_lengths]
        if ruler:
            row += [m["ruler"]["by_length"][n] for n in ruler_lengths]
        rows.append(row)
    text = (
        f"# rope-ext compare: {setup['model']}\n\n"
        f"Original window {setup['original_window']} tokens. PPL: token-weighted, data {setup['data']} "
        f"({setup['documents']} document(s)), "
        + ("first L tokens of each document" if setup["stride"] is None else f"stride {setup['stride']}")
        + "."
    )
    if pk:
        text += (
            f" Passkey: accuracy over depths {setup['passkey']['depths']} x {setup['passkey']['trials']} trial(s), "
            f"greedy {setup['passkey']['max_new_tokens']} tokens."
        )
    if ruler:
        counts = sorted(set(ruler["samples"].values()))
        text += (
            f" {ruler['task']}: lm-eval's RULER task, share of the needles the answer holds, over "
            f"{'/'.join(map(str, counts))} sample(s) per length."
        )
    text += "\n\n" + output.markdown_table(header, rows)
    longest = str(lengths[-1])
    buckets = [(b["start"], b["end"]) for b in rows_in[0]["ppl"][longest]["buckets"]] if rows_in else []
    if buckets:
        best = {span: min(bucket_ppl(m, longest)[span] for m in rows_in) for span in buckets}
        table = [
            [m["label"]] + [f"**{p:.2f}**" if p == best[span] else f"{p:.2f}" for span, p in bucket_ppl(m, longest).items()]
            for m in rows_in
        ]
        text += f"\n\nPPL at length {longest} by position of the scored token (lowest in bold):\n\n" + output.markdown_table(
            ["method"] + [f"{a}-{b}" for a, b in buckets], table
        )
    return text


def bucket_ppl(method_result: dict, length: str) -> dict:
    return {(b["start"], b["end"]): b["ppl"] for b in method_result["ppl"][length]["buckets"]}


def ruler_tasks() -> list[str]:
    """The tasks of lm-eval's `ruler` group (its ruler.yaml): each reports one score per length."""
    group = resources.files("lm_eval.tasks") / "ruler" / "ruler.yaml"
    return yaml.safe_load(group.read_text())["task"]


def check_ruler(args: argparse.Namespace) -> None:
    """The RULER options, before the model loads."""
    if args.ruler_samples is None:
        for option, value in (("--ruler-task", args.ruler_task), ("--ruler-lengths", args.ruler_lengths)):
            if value is not None:
                raise ValueError(f"{option} needs --ruler-samples K (the samples per method and length)")
        return
    if not 1 <= args.ruler_samples <= RULER_SAMPLES:
        raise ValueError(
            f"--ruler-samples {args.ruler_samples}: RULER builds {RULER_SAMPLES} samples per length; choose 1 to {RULER_SAMPLES}"
        )
    if any(n < 1 for n in args.ruler_lengths or []):
        raise ValueError(f"--ruler-lengths must be positive, got {args.ruler_lengths}")
    require("eval", "--ruler-samples (lm-eval's RULER tasks)", ("lm_eval",))
    if importlib.util.find_spec("wonderwords") is None:
        raise ValueError("--ruler-samples: lm-eval's RULER tasks need the wonderwords package: pip install 'rope-ext[ruler]'")
    known = ruler_tasks()
    if (args.ruler_task or RULER_TASK) not in known:
        raise ValueError(f"--ruler-task {args.ruler_task!r} is not a RULER task; choose from {', '.join(known)}")


class Ruler:
    """One of lm-eval's RULER tasks for every method: its prompts are built once, with the
    evaluated checkpoint's tokenizer, and every method answers the same first `samples` prompts of
    each length (lm-eval's --limit would take the first length's only)."""

    def __init__(self, task: str, lengths: list[int], samples: int, model_name: str | None):
        from lm_eval.tasks import TaskManager

        from .lm_eval_model import with_task_tokenizer

        self.lengths = lengths
        self.manager = TaskManager(metadata=with_task_tokenizer({"pretrained": model_name}, {"max_seq_lengths": lengths}))
        self.task = self.manager.load([task])["tasks"][task]
        picked = {n: [] for n in lengths}
        for index, length in enumerate(self.task.eval_docs["max_length"]):
            if len(picked[length]) < samples:
                picked[length].append(index)
        self.indices = sorted(i for chosen in picked.values() for i in chosen)
        self.samples = {n: len(chosen) for n, chosen in picked.items()}

    def setup(self) -> dict:
        return {"task": self.task.task_name, "lengths": self.lengths, "samples": self.samples}

    def scores(self, model_args: dict) -> dict[int, float]:
        """{length: score in [0, 1]} of the rope_ext model type built from `model_args`."""
        import lm_eval

        from .lm_eval_model import RopeExtLM

        name = self.task.task_name
        out = lm_eval.simple_evaluate(
            model=RopeExtLM(**model_args),
            tasks=[self.task],
            task_manager=self.manager,
            samples={name: self.indices},
            log_samples=False,
            bootstrap_iters=0,
        )
        return {n: out["results"][name][f"{n},none"] for n in self.lengths}


def check(args: argparse.Namespace):
    """(runs, texts, result folder): every argument and method spec checked before the model
    loads. Without --factor the factor follows from the model's window, so the specs are checked
    at factor 2 here and patched at the factor the run finds."""
    if args.factor is not None:
        check_factor(args.factor)
    if args.chunk_size is not None:
        as_size(args.chunk_size, "--chunk-size")
    runs = parse_specs(args.methods or default_methods(), args.param)
    for _, method, params in runs:
        loading.check_method(method, None if method == loading.PLAIN else args.factor or 2.0, params)
        if args.chunk_size is not None:
            loading.check_chunking(method, args.factor or 2.0, params)
    perplexity.check_windows(args.lengths, args.stride, args.bucket)
    if not args.no_passkey:
        passkey.check_grid(args.passkey_lengths, args.passkey_depths, args.passkey_trials, args.max_new_tokens)
    check_ruler(args)
    loading.check_model(args.model, args.device)
    texts = data_mod.texts_from_args(args)
    out = output.ResultFolder(args.output, "compare", ["compare.json", "compare.md", "compare.png"], args.overwrite).claim()
    return runs, texts, out


def run(args: argparse.Namespace, plan) -> int:
    runs, texts, out = plan
    model, tokenizer = loading.load_model(args.model, args.dtype, args.device, args.attn_implementation)
    loading.apply_method(model, loading.PLAIN)
    window = original_window(model)
    lengths = sorted(set(args.lengths or [window // 2, window, 2 * window]))
    factor = args.factor or max(2.0, float(math.ceil(lengths[-1] / window)))
    if args.stride is not None and args.stride > lengths[0]:
        raise ValueError(f"--stride {args.stride} is larger than the shortest length {lengths[0]}")
    documents = data_mod.documents_from_args(args, texts, tokenizer)
    bos, bos_id = perplexity.bos_token(tokenizer, args.bos)
    passkey_lengths = sorted(set(args.passkey_lengths or lengths))
    if not args.no_passkey:
        shortest = passkey.minimum_length(tokenizer)
        if passkey_lengths[0] < shortest:
            raise ValueError(
                f"length {passkey_lengths[0]} is too small for the passkey prompt ({shortest} tokens); "
                "raise --lengths / --passkey-lengths or pass --no-passkey"
            )
    ruler = None
    if args.ruler_samples is not None:
        ruler = Ruler(args.ruler_task or RULER_TASK, sorted(set(args.ruler_lengths or lengths)), args.ruler_samples, args.model)

    report = {
        "setup": {
            "model": measured.model_label(model),
            "original_window": window,
            "lengths": lengths,
            "factor": factor,
            "data": args.data,
            "documents": len(documents),
            "document_tokens": [len(d) for d in documents],
            "stride": args.stride,
            "bos": bos,
            "passkey": None
            if args.no_passkey
            else {
                "lengths": passkey_lengths,
                "depths": args.passkey_depths,
                "trials": args.passkey_trials,
                "seed": args.seed or 0,
                "max_new_tokens": args.max_new_tokens,
            },
            "ruler": None if ruler is None else ruler.setup(),
        },
        "methods": [],
        "provenance": output.provenance(model, args.model),
    }
    for label, method, params in runs:
        print(f"rope-ext compare: {label}", file=sys.stderr)
        started = time.perf_counter()
        info = loading.apply_method(model, method, None if method == loading.PLAIN else factor, params)
        measured.warn_beyond_capacity(model, lengths[-1] + int(bos), f"{label} at length {lengths[-1]}")
        ppl = perplexity.evaluate(
            model,
            documents,
            lengths,
            stride=args.stride,
            bos=bos,
            bos_id=bos_id,
            truncate=args.stride is None,
            bucket=args.bucket,
            chunk_size=args.chunk_size,
            progress=not args.no_progress,
        )
        result = {
            "label": label,
            "method": method,
            "params": params,
            "factor": None if info is None else info.factor,
            "patch": None if info is None else info.to_dict(),
            "ppl": {str(n): r for n, r in ppl.items()},
        }
        if not args.no_passkey:
            answer = passkey.model_answerer(model, tokenizer, args.max_new_tokens, chunk_size=args.chunk_size)
            result["passkey"] = passkey.run_trials(
                answer,
                tokenizer,
                passkey_lengths,
                args.passkey_depths,
                args.passkey_trials,
                (args.seed or 0,),
                progress=not args.no_progress,
            )
        if ruler is not None:
            # the same model as the columns before, loaded again by the rope_ext model type: the
            # scores are what `rope-ext lm-eval --model rope_ext` reports for this spec. max_length
            # covers the longest prompt, so lm-eval truncates none, past the window too.
            model_args = {
                "pretrained": args.model,
                "method": method,
                "factor": None if method == loading.PLAIN else factor,
                **params,
                "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                "device": loading.resolve_device(args.device),
                "attn_implementation": args.attn_implementation,
                "max_length": ruler.lengths[-1],
            }
            result["ruler"] = {"by_length": ruler.scores(model_args)}
        result["seconds"] = round(time.perf_counter() - started, 1)
        report["methods"].append(result)
        # written after every method, so a long run that is stopped keeps what finished
        partial = output.ResultFolder(out.folder, "compare", [], overwrite=True)
        partial.write_json("compare.partial.json", report)

    out.write_json("compare.json", report)
    text = markdown(report) + "\n" + output.provenance_line(report["provenance"])
    out.write_text("compare.md", text)
    (out.folder / "compare.partial.json").unlink()
    from .plots import compare_figure

    out.save_figure("compare.png", compare_figure(report))
    print(text)
    print(f"results in {out.folder}")
    return 0
