"""Pretrain the tiny LLaMA that the tests measure context extension on.

    python recipes/pretrain_tiny.py [--config recipes/configs/tiny.yaml] [--out DIR] [--force]

A ~1M-parameter LlamaForCausalLM with a 128-token window, trained from scratch in a few CPU
minutes on the Gutenberg plays (rope_ext.defaults) with the Gutenberg BPE tokenizer. Every
training sequence is exactly one window long, so the model never sees a position >= W: that is
what makes plain RoPE fail past W and gives the scaling methods something to fix.

The checkpoint (weights, config, tokenizer, train_log.json) is cached in
cache_dir()/tiny-<hash>, where the hash covers the config, the training source
(rope_ext.training.tiny and the modules it trains with) and the tokenizer, so an edited recipe or
config trains a new one. Importable: `rope_ext.training.tiny.ensure_tiny()` and `heldout_ids()`.

Speed: training runs on `training.threads` torch threads (1): about 3 CPU minutes. Two threads
are faster only on idle cores; on cores that other jobs also use they slow down several-fold.
"""

from __future__ import annotations

import argparse

from rope_ext.training.tiny import DEFAULT_CONFIG, ensure_tiny


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default: %(default)s)")
    parser.add_argument("--out", help="checkpoint directory (default: cache_dir()/tiny-<hash>)")
    parser.add_argument("--force", action="store_true", help="retrain even if the checkpoint exists")
    args = parser.parse_args(argv)
    path = ensure_tiny(args.config, force=args.force, out=args.out)
    print(path)


if __name__ == "__main__":
    main()
