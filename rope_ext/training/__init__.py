"""The building blocks of the recipes in recipes/ (installed as `rope_ext.training`).

Shared by every recipe:
plays        the Gutenberg plays as training and held-out token streams
optim        AdamW that decays matrices only, with warmup and cosine decay
loop         next-token loss, one optimizer step, the mean of the recent losses

tiny         the tiny LLaMA the tests measure on: trained once, cached (recipes/pretrain_tiny.py)

The LoRA fine-tune (recipes/finetune.py), in the order `finetune.train` uses them:
config       defaults, YAML and flags, checks that need no model
model        the checkpoint to load, the patch, the LoRA wrapping
data         documents, tokenization through datasets (cached), packing
checks       checks that need the model, the launch or the data
distributed  the Accelerator, ranks, preparing, one accumulated optimizer step
s2_attention LongLoRA's shifted sparse attention and the switch to full attention
order        which sequence each step, micro-step and rank trains on
checkpoints  saving (the trained weights only), finding and resuming training state
evaluation   held-out perplexity at the training length
progress     the progress bar, the per-step log (loss, lr, tokens/s) and trackers, the clock
outputs      the adapter, the record, train_log.json, loss.png, results.md, merged weights
finetune     the recipe: `train` step by step, `main` for the command line
"""
