"""`rope-ext dpe-probe`: DPE's detection of each dimension group's effective relative distance
(Lu et al. 2025, arXiv 2504.18857, section "Detecting the Effective Relative Distance"; the
authors' effective_length_detection/run_niah_detect.sh), with rope-ext's passkey needles.

The authors' procedure, followed here: every group but one is held at a base scale f (theirs:
twice the target length over the trained window, 32 for Llama-3-8B from 8k to 128k); the one
group is moved over multiples of f (f/16, f/4, f/2, f, 2f, 4f, 16f; whole numbers >= 1 here); at
each setting needle prompts of the target length are answered. The best scale of a group is the
one that retrieves most (here: ties go to the lower answer loss), and its effective distance is
the largest relative distance the group then gives at the target length,
floor((N - 1)/s) + W - floor(W/s) (rope_ext.method.dpe.group_distances). The best scales together
are a `scales` list for `--method dpe`.

A prompt counts as retrieved when greedy decoding would give the key: every answer token is the
argmax of its row, with the key's earlier tokens as the prefix (one forward per prompt, no
generation). The answer loss is the mean cross-entropy of those tokens, as `rope-ext search`
scores. The authors detect with 4-needle NIAH over Paul Graham essays and their top-k key
dimensions selected (not in rope-ext); this probe uses one passkey per prompt.

Writes dpe_probe.json (every setting's counts, Wilson interval and loss, the best scale and
distance per group, the scales list, the provenance) and dpe_probe.md (the table)."""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rope_ext import loading
from rope_ext.evals import output
from rope_ext.evals.retrieval import counts
from rope_ext.method.base import as_size, check_factor
from rope_ext.method.dpe import NAME as DPE
from rope_ext.method.dpe import group_distances
from rope_ext.tuning.search import DEPTHS, Needle, needles

RESULT = "dpe_probe.json"
TABLE = "dpe_probe.md"
MULTIPLES = (1 / 16, 1 / 4, 1 / 2, 1, 2, 4, 16)  # of the base scale: run_niah_detect.sh's detection values


def parse_scales(text: str, what: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4], each an int >= 1, sorted and without repeats."""
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated whole numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{what} names no scale")
    return sorted({as_size(value, f"{what}: each scale") for value in values})


def default_base(length: int, trained: int) -> int:
    """The authors' base scale: twice the target length over the trained window."""
    return max(1, round(2 * length / trained))


def default_candidates(base: int) -> list[int]:
    return sorted({max(1, math.floor(base * multiple)) for multiple in MULTIPLES})


@torch.no_grad()
def answers(model, prompts: list[Needle]) -> list[tuple[bool, float]]:
    """(retrieved under greedy decoding, mean cross-entropy of the answer tokens) of each prompt."""
    device = next(model.parameters()).device
    found = []
    for needle in prompts:
        logits = model(needle.ids.to(device), logits_to_keep=needle.answer + 1).logits[0, :-1].float()
        target = needle.ids[0, -needle.answer :].to(device)
        found.append((bool((logits.argmax(-1) == target).all()), F.cross_entropy(logits, target).item()))
    return found


def check(args: argparse.Namespace) -> dict:
    """Every argument, before the model loads."""
    check_factor(args.factor)
    as_size(args.groups, "--groups")
    as_size(args.samples, "--samples")
    for flag, value in (("--base", args.base), ("--window", args.window), ("--original-window", args.original_window)):
        if value is not None:
            as_size(value, flag)
    if args.length is not None:
        as_size(args.length, "--length", minimum=2)
    candidates = None if args.candidates is None else parse_scales(args.candidates, "--candidates")
    loading.check_model(args.model, args.device)
    folder = output.ResultFolder(args.output, "dpe-probe", [RESULT, TABLE], args.overwrite).claim()
    return {"folder": folder, "candidates": candidates}


def run(args: argparse.Namespace, plan: dict) -> int:
    model, tokenizer = loading.load_model(args.model, args.dtype, args.device)
    record = output.provenance(model, args.model)
    params = {"window": args.window, "inside_window": args.inside_window}

    def patch(scales: list[int] | None):
        return loading.apply_method(model, DPE, args.factor, {**params, "scales": scales}, args.original_window)

    info = patch(None)
    trained, window, pairs = info.original_window, info.params["window"], info.rotary_dim // 2
    if pairs % args.groups:
        raise ValueError(f"--groups {args.groups} does not split this model's {pairs} frequency pairs into equal groups")
    length = args.length or math.ceil(trained * args.factor)
    if length <= (window if args.inside_window else trained):
        raise ValueError(
            f"--length {length} does not reach past the {'local' if args.inside_window else 'trained'} window, where dpe "
            "scales nothing: every setting would score alike; give a longer length"
        )
    base = args.base or default_base(length, trained)
    # the base is always a candidate: a group may be best left where the others are
    candidates = sorted({*(plan["candidates"] or default_candidates(base)), base})
    prompts = needles(tokenizer, length, args.samples, args.seed, args.needle, DEPTHS)
    settings = [None] + [(group, scale) for group in range(args.groups) for scale in candidates if scale != base]
    scored = {}
    for setting in tqdm(settings, desc="dpe-probe", disable=args.no_progress):
        scales = [base] * args.groups
        if setting is not None:
            scales[setting[0]] = setting[1]
        patch(scales)
        scored[setting] = answers(model, prompts)

    def row(scale: int, found: list[tuple[bool, float]]) -> dict:
        cells = counts([{"correct": correct} for correct, _ in found])
        loss = sum(value for _, value in found) / len(found)
        return {"scale": scale, "largest_distance": group_distances(length, [scale], window)[0], **cells, "loss": loss}

    groups = []
    for group in range(args.groups):
        rows = [row(scale, scored[None] if scale == base else scored[group, scale]) for scale in candidates]
        best = max(rows, key=lambda r: (r["correct"], -r["loss"]))
        size = pairs // args.groups
        groups.append({"group": group, "pairs": [group * size, (group + 1) * size], "rows": rows, "best": best})
    scales = [g["best"]["scale"] for g in groups]
    result = {
        "setup": {
            "model": record["model"],
            "length": length,
            "factor": args.factor,
            "trained_window": trained,
            "window": window,
            "inside_window": args.inside_window,
            "groups": args.groups,
            "pairs": pairs,
            "base": base,
            "candidates": candidates,
            "samples": len(prompts),
            "needle": args.needle,
            "seed": args.seed,
        },
        "baseline": row(base, scored[None]),
        "groups": groups,
        "scales": scales,
        "param": f"--param scales=[{','.join(map(str, scales))}]",
        "provenance": record,
    }
    folder = plan["folder"]
    folder.write_json(RESULT, result)
    text = table(result)
    folder.write_text(TABLE, text + "\n" + output.provenance_line(record))
    print(text)
    print(f"wrote {folder.path(RESULT)} and {folder.path(TABLE)}")
    return 0


def table(result: dict) -> str:
    """The probe as markdown: one row per group and scale, the best of each group marked."""
    setup = result["setup"]
    header = ["group", "pairs", "scale", "largest distance", "retrieved", "95% interval", "answer loss", "best"]
    rows = []
    for group in result["groups"]:
        for r in group["rows"]:
            low, high = r["interval"]
            span = f"{group['pairs'][0]}-{group['pairs'][1] - 1}"
            mark = "best" if r["scale"] == group["best"]["scale"] else ""
            rows.append(
                [
                    group["group"],
                    span,
                    r["scale"],
                    r["largest_distance"],
                    f"{r['correct']}/{r['total']}",
                    f"{low:.2f}-{high:.2f}",
                    r["loss"],
                    mark,
                ]
            )
    base = result["baseline"]
    intro = (
        f"DPE probe: {setup['samples']} passkey prompts ({setup['needle']}) of {setup['length']} tokens, trained window "
        f"{setup['trained_window']}, local window {setup['window']}, {setup['groups']} groups of "
        f"{setup['pairs'] // setup['groups']} frequency pairs (group 0 the fastest); one group moved at a time, the "
        f"others at scale {setup['base']} (every group there: {base['correct']}/{base['total']} retrieved, answer loss "
        f"{base['loss']:.3f}).\n\n"
    )
    return intro + output.markdown_table(header, rows) + f"\nBest scales: {result['param']}\n"
