"""LoRA fine-tune of a rope-ext patched model at its extended window (YaRN / LongLoRA style).

    accelerate launch recipes/finetune.py --config recipes/configs/finetune_tiny.yaml [--flags]
    python recipes/finetune.py --config ...            # one process, same thing

Loads a checkpoint ("smollm2" = the embedded SmolLM2, "tiny" = the test suite's tiny model, a
local folder or a hub id), patches it with `rope_ext.patch(method, factor)`, wraps it in a peft
LoRA (optionally training embeddings and norms too, as LongLoRA does), packs documents into
sequences of the target length and trains with warmup + cosine, gradient accumulation and
(optionally) gradient checkpointing and LongLoRA's shifted sparse attention, over a float32,
bfloat16/float16 (--dtype) or 4-bit (--load-in-4bit, QLoRA) base. Flags override the YAML.
Runs on one CPU, DDP, FSDP2 or DeepSpeed through accelerate (recipes/configs/accelerate/).

Output folder: the adapter + tokenizer + rope_ext_finetune.json (reload with
`rope_ext.from_pretrained(out)`; where transformers' rope_parameters express the patch, base/ is
the patched base for peft's and transformers' own loaders, otherwise those loaders are refused),
train_log.json, results.md and loss.png (the per-step loss, lr and tokens/s, and the perplexity
at the target length over training; `--log-with tensorboard` also feeds accelerate's trackers
under logs/), checkpoints/step-N (the trained weights, optimizer, schedule and RNG every
--save-every steps, written atomically; `--resume` continues from the newest with the same data
order) and, with --merge, merged/ (a full patched model: `rope_ext.from_pretrained(out /
"merged")`, or plain transformers where the patch has native rope_parameters).
"""

import sys

from rope_ext.training.config import ConfigError
from rope_ext.training.finetune import main

if __name__ == "__main__":
    try:
        main()
    except ConfigError as err:
        sys.exit(f"finetune: error: {err}")
