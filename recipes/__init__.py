"""The recipes, installed as `rope_ext.recipes` together with their configs (configs/), so that an
install without the checkout has them too:

finetune       the LoRA fine-tune: `accelerate launch recipes/finetune.py --config ...` from a
               checkout; installed, `rope-ext finetune --config ...` (one process) or
               `accelerate launch -m rope_ext.recipes.finetune --config ...`
pretrain_tiny  the tiny LLaMA the tests measure on (`rope_ext.training.tiny.ensure_tiny()`)
pe_study       the position-encoding study
configs/       their YAML configs, and accelerate's launch configs under configs/accelerate/
"""
