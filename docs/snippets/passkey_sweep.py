"""Dense passkey sweeps side by side: the per-depth table (markdown) and the heatmap of
docs/results.md, from passkey.json files.

    python docs/snippets/passkey_sweep.py --output FIGURE.png LABEL=passkey.json [LABEL=passkey.json ...]
"""

import argparse
import json
from pathlib import Path

from rope_ext.evals.output import markdown_table
from rope_ext.evals.plots import passkey_sweep
from rope_ext.evals.retrieval import counts

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("runs", nargs="+", metavar="LABEL=FILE")
parser.add_argument("--output", required=True, help="the figure's PNG")
args = parser.parse_args()
runs = {}
for spec in args.runs:
    label, _, path = spec.partition("=")
    runs[label] = json.loads(Path(path).read_text(encoding="utf-8"))
depths = sorted({float(t["depth"]) for r in runs.values() for t in r["trials"]})
rows = []
for label, result in runs.items():
    cells = [[t for t in result["trials"] if float(t["depth"]) == d] for d in depths]
    overall = counts(result["trials"])
    interval = "{:.2f}-{:.2f}".format(*overall["interval"])
    # a depth a run has not asked (a stopped run's passkey.partial.json, another grid): no cell
    shown = ["{correct}/{total}".format(**counts(cell)) if cell else "-" for cell in cells]
    rows.append([label, *shown, f"{overall['correct']}/{overall['total']}", interval])
print(markdown_table(["run \\ depth"] + [f"{d:g}" for d in depths] + ["all", "95% interval"], rows))
passkey_sweep(runs).savefig(args.output, dpi=110, bbox_inches="tight")
print(f"figure: {args.output}")
