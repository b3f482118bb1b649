"""Where each passkey prompt of a run puts its key line, and how the line tokenizes: the prompt is
rebuilt from the run's length, depth and key with the embedded SmolLM2's tokenizer (docs/results.md,
"Between the five depths").

    python docs/snippets/key_lines.py passkey.json [--depths 0.15 0.2 0.25]

One row per trial: depth, seed, hit or miss, the key line's first token, the tokens from it to the
prompt's end, the line's length in tokens, and the line with the token before and after it.
"""

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from rope_ext.defaults import smollm2_path
from rope_ext.evals.attention_mass import passkey_spans
from rope_ext.evals.passkey import build_prompt

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("run", type=Path, help="a passkey.json of the embedded SmolLM2")
parser.add_argument("--depths", type=float, nargs="+", help="only these depths (default: all)")
args = parser.parse_args()
tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
trials = json.loads(args.run.read_text(encoding="utf-8"))["trials"]
print("| depth | seed | answer | key line at token | tokens from it to the end | line tokens | the line, one token either side |")
print("|---|---|---|---|---|---|---|")
for t in sorted(trials, key=lambda t: (t["seed"], t["depth"], t["trial"])):
    if args.depths and not any(abs(t["depth"] - d) < 1e-9 for d in args.depths):
        continue
    prompt = build_prompt(tokenizer, t["length"], t["depth"], t["key"])
    start, end = passkey_spans(tokenizer, prompt, near=1, bins=1)["key line"]
    shown = tokenizer.convert_ids_to_tokens(prompt.ids[start - 1 : end + 1])
    answer = "hit" if t["correct"] else "**miss**"
    print(
        f"| {t['depth']:g} | {t['seed']} | {answer} | {start} | {len(prompt.ids) - start} | {end - start} | `{' '.join(shown)}` |"
    )
