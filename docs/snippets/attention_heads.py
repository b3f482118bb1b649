"""The rows of docs/results.md's attention tables from a `rope_ext.evals.attention_mass` JSON: per
prompt, for each named layer, the head that puts the most of the first answer token's attention on
the key line, with its mass on the key line / the task line / the filler (before and after the key).

    python docs/snippets/attention_heads.py docs/results/smollm2-attention-mass-plain-8k-near.json [--layers 18 20 23]
"""

import argparse
import json
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("run", type=Path, help="an attention_mass JSON")
parser.add_argument("--layers", type=int, nargs="+", default=[18, 20, 23], help="layers to show (default: 18 20 23)")
args = parser.parse_args()
run = json.loads(args.run.read_text())
setup = run["setup"]
name = setup["method"] if setup["factor"] is None else f"{setup['method']} x{setup['factor']:g}"

print(
    "| run | depth | key line at token | tokens before the question | answer | "
    + " | ".join(f"layer {layer}" for layer in args.layers)
    + " |"
)
print("|---" * (5 + len(args.layers)) + "|")
for prompt in sorted(run["prompts"], key=lambda p: p["depth"]):
    mass, start = prompt["mass"], prompt["spans"]["key line"][0]
    cells = []
    for layer in args.layers:
        key = mass["key line"][layer]
        head = max(range(len(key)), key=key.__getitem__)
        filler = mass["filler before"][layer][head] + mass["filler after"][layer][head]
        cells.append(f"h{head}: {key[head]:.2f} / {mass['task'][layer][head]:.2f} / {filler:.2f}")
    answer = "hit" if prompt["correct"] else "**miss**"
    print(
        f"| {name}, {setup['length']} | {prompt['depth']:g} | {start} | {prompt['prompt_tokens'] - start} | {answer} | "
        + " | ".join(cells)
        + " |"
    )
