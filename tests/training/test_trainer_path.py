"""The plain Hugging Face route to a long-context fine-tune, as docs/finetune.md shows it:
rope_ext.patch, then peft.get_peft_model, then transformers.Trainer with activation (gradient)
checkpointing.
A few steps on the tiny model train the adapter and leave the patch in place."""

from __future__ import annotations

import pytest
import torch

import rope_ext

pytestmark = pytest.mark.integration  # each test trains


@pytest.mark.parametrize("method", ["yarn", "self_extend"])
def test_trainer_trains_a_lora_on_a_patched_model(tiny_model, tiny_path, heldout_ids, tmp_path, method):
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from rope_ext.saving import load_finetuned, save_record

    info = rope_ext.patch(tiny_model, method, factor=2)  # the tiny model's 128-token window -> 256
    model = get_peft_model(tiny_model, LoraConfig(r=4, lora_alpha=8, target_modules=rope_ext.lora_targets(tiny_model)))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    n = info.max_length
    rows = [{"input_ids": heldout_ids[i * n : (i + 1) * n], "labels": heldout_ids[i * n : (i + 1) * n]} for i in range(4)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()

    assert tiny_model.is_activation_checkpointing
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    changed = [name for name, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[name])]
    assert changed and all("lora_" in name for name in changed)
    described = rope_ext.describe(tiny_model)
    assert described["method"] == method and described["max_length"] == n

    model.save_pretrained(tmp_path / "adapter")
    save_record(tmp_path / "adapter", str(tiny_path), model)
    reloaded = load_finetuned(tmp_path / "adapter")
    assert rope_ext.describe(reloaded)["method"] == method
    name = changed[0]
    assert torch.equal(dict(reloaded.named_parameters())[name], dict(model.named_parameters())[name])
