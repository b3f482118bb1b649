"""Position-encoding study: train one small decoder per position encoding, compare extrapolation.

    python recipes/pe_study.py [--config recipes/configs/pe_study.yaml] [--out results/pe_study] [--overwrite]

Every encoding (learned absolute, sinusoidal, T5 relative bias, DeBERTa disentangled attention,
ALiBi, RoPE) gets the same LLaMA-shaped decoder, the same initial weights, the same training
windows in the same order, and the same number of steps, on the Gutenberg plays with window W.
Each is then scored on held-out plays at W, 2W, 4W, 8W; the RoPE model is also scored with the
training-free extensions of `rope_ext.patch` (factor = length / W) as extra rows.

Every evaluation cell (one model at one length) runs in a fresh process forked from a clean
server, so its peak memory is its own: ru_maxrss after the run minus ru_maxrss once the model is
loaded and warmed up. tracemalloc would miss torch's allocations and sampling RSS can miss short
peaks; the kernel's high-water mark misses nothing. tokens/s = scored tokens / wall time.

Writes pe_study.json, pe_study.md and pe_study.png into --out, plus the trained checkpoints, and
refuses to replace earlier results unless --overwrite is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rope_ext.study.config import load_config
from rope_ext.study.run import run_study, write_results

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "pe_study.yaml"
DEFAULT_OUT = Path("results") / "pe_study"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    out = Path(args.out)
    results = run_study(cfg, out, args.overwrite)
    markdown = write_results(results, out)
    print(markdown)
    print(f"results in {out}/: pe_study.json, pe_study.md, pe_study.png", file=sys.stderr)


if __name__ == "__main__":
    main()
