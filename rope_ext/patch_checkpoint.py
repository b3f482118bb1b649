"""`rope-ext patch MODEL OUT --method M --factor F`: the checkpoint MODEL patched, written to OUT
with its weights untouched (loaded and saved in their own dtype), its tokenizer and generation
config, and what each serving engine computes from the written config.json (rope_ext.serving)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rope_ext import defaults, method as registry
from rope_ext.method.base import as_size


def check(args: argparse.Namespace) -> dict:
    """The destination, the method spec and the model's name, before any weight is read; returns
    the method parameters."""
    from rope_ext.evals.loading import check_model, parse_params

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder; choose a new folder")
    params = parse_params(args.param)
    registry.check(args.method, args.factor, params)
    if args.original_window is not None:
        as_size(args.original_window, "--original-window")
    check_model(None if args.model == defaults.SMOLLM2 else args.model, "cpu")
    return params


def run(args: argparse.Namespace, params: dict) -> int:
    import rope_ext
    from rope_ext import serving
    from rope_ext.evals.loading import apply_method
    from rope_ext.patching import engine_verdicts

    source = defaults.resolve_checkpoint(args.model)
    model = rope_ext.from_pretrained(source, dtype="auto")
    info = apply_method(model, args.method, args.factor, params, args.original_window, args.allow_shrink)
    out = Path(args.out)
    model.save_pretrained(out)
    copied = "tokenizer"
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source).save_pretrained(out)
    except (OSError, ValueError):
        copied = "no tokenizer (none found beside the weights)"
    base = info.starts_from
    scaling = f"its shipped {base['scaling']} scaling" if base["scaling"] else "the trained frequencies"
    print(f"{args.method} x{info.factor:g}: {scaling} over a {info.original_window}-token window ({base['source']}),")
    print(f"meant for {info.max_length} tokens; wrote {out} (weights, config, {copied}, generation config)")
    transformers = "as patched" if info.native else "unpatched (rope_ext.from_pretrained re-applies the patch)"
    found = {"transformers": transformers, **engine_verdicts(model, info.native is not None)}
    print("what each engine serves from the written config.json:")
    print(serving.table(found))
    return 0
