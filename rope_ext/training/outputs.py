"""What a fine-tune leaves in its output folder: the adapter, the tokenizer, the fine-tune record,
train_log.json, results.md, loss.png and, if asked, the merged weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from matplotlib.figure import Figure

from rope_ext.saving import load_finetuned, save_record


def save_adapter(accelerator, model, out: Path):
    """Write the adapter from the main process (every rank takes part in gathering a sharded
    state); returns the unwrapped peft model."""
    state = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    # Under FSDP2 the gathered state exists on the main process only; the others get {}, on which
    # peft's save_pretrained fails even where it is told not to write.
    if accelerator.is_main_process:
        unwrapped.save_pretrained(str(out), state_dict=state)
    return unwrapped


def write_outputs(out: Path, log: dict, model, tokenizer) -> None:
    """Everything but the adapter, from the main process: `model` is the unwrapped peft model."""
    tokenizer.save_pretrained(out)
    save_record(out, log["base_model"], model, {"seq_len": log["seq_len"]})
    (out / "train_log.json").write_text(json.dumps(log, indent=2, default=str) + "\n")
    write_results(out, log)
    loss_figure(log).savefig(out / "loss.png", dpi=100)
    if log["config"]["output"]["merge"]:
        # the adapter folded into the base in the dtype it trained on (a 4-bit base unquantized)
        merged = load_finetuned(out, merge=True, dtype=getattr(torch, log["config"]["model"]["dtype"]))
        merged.save_pretrained(out / "merged")
        tokenizer.save_pretrained(out / "merged")


def loss_figure(log: dict) -> Figure:
    """The training loss of every step and the held-out NLL of every eval (both nats per token)."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    ax.plot([h["step"] for h in log["history"]], [h["loss"] for h in log["history"]], lw=1, label="training loss (per step)")
    if log["evals"]:
        ax.plot([e["step"] for e in log["evals"]], [e["nll"] for e in log["evals"]], "o-", label="held-out NLL")
    patch = log["config"]["patch"]
    ax.set(
        xlabel="optimizer step", ylabel="nats per token", title=f"{patch['method']} x{patch['factor']} at {log['seq_len']} tokens"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def write_results(out: Path, log: dict) -> None:
    rows = [f"| {e['step']} | {e['ppl']:.3f} | {e['nll']:.4f} | {e['tokens']} |" for e in log["evals"]]
    patch = log["config"]["patch"]
    text = "\n".join(
        [
            f"# Fine-tune: {patch['method']} x{patch['factor']} at {log['seq_len']} tokens",
            "",
            f"Base model `{log['base_model']}` (window {log['patch']['original_window']}), LoRA r={log['config']['lora']['r']}, "
            f"{log['steps']} steps, {log['tokens_trained']:,} tokens, {log['seconds']} s ({log['tokens_per_s']:,} tokens/s).",
            "",
            f"Held-out perplexity at {log['seq_len']} tokens (step 0 = the training-free patch):",
            "",
            "| step | PPL | NLL | tokens |",
            "|---|---|---|---|",
            *rows,
            "",
        ]
    )
    (out / "results.md").write_text(text)
