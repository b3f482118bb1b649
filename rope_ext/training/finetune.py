"""LoRA fine-tune of a rope-ext patched model at its extended window (YaRN / LongLoRA style).

The recipe behind recipes/finetune.py: `train` goes through it step by step over the building
blocks of rope_ext.training, `main` reads the YAML and the flags first.
"""

from __future__ import annotations

from pathlib import Path

from rope_ext.extras import require

require("finetune", "the fine-tune (rope_ext.training.finetune)")
from accelerate.utils import set_seed  # noqa: E402

from .checkpoints import TrainingState, checkpoint_layout, checkpoint_to_resume, save_checkpoint, start_or_resume
from .checks import (
    check_eval_documents,
    check_launch,
    check_length,
    check_parallelism,
    check_pose_length,
    check_precision,
    check_quantization,
    check_sequences,
    check_trackers,
)
from .config import config_digest, parse_args
from .data import first_tokens, load_documents, pack, token_stream
from .distributed import context_parallel_size, data_parallel_rank, make_accelerator, prepare, replica_digests, train_step
from .evaluation import HeldOut
from .loop import RecentLoss
from .model import load_patched, lora_model, lora_targets, resolve_model
from .optim import adamw_cosine
from .order import DataOrder
from .outputs import save_adapter, write_outputs
from .pose import SkipPositions
from .progress import Progress, StepLog, tracker_config
from .s2_attention import AttentionSwitch


def train(cfg: dict, resume: str | None) -> dict:
    """Run the fine-tune `cfg` describes (from scratch, or from a checkpoint with `resume`);
    returns train_log.json's content on the main process, {} elsewhere."""
    run = cfg["training"]
    out = Path(cfg["output"]["dir"]).resolve()
    check_trackers(cfg["output"]["log_with"])
    accelerator = make_accelerator(cfg, out)
    main = accelerator.is_main_process
    dp_rank, dp_size = data_parallel_rank(accelerator)
    cp_size = context_parallel_size(accelerator)
    digest = config_digest(cfg)

    # ---- everything that can refuse the run happens before the first step
    check_launch(accelerator)
    checkpoint = checkpoint_to_resume(out, resume, cfg, dp_size, checkpoint_layout(accelerator))
    check_parallelism(cfg, cp_size)
    check_precision(cfg, accelerator.mixed_precision)
    check_quantization(cfg, accelerator)
    with accelerator.main_process_first():
        model_path, base_record = resolve_model(cfg["model"]["path"])
    tokenizer, model, info = load_patched(model_path, cfg, accelerator.device)
    # PoSE trains at the original window and evaluates at the patched one it stretches to
    pose = run["pose"]
    seq_len = cfg["data"]["seq_len"] or (info.original_window if pose else info.max_length)
    eval_len = info.max_length if pose else seq_len
    check_length(cfg, seq_len, info.max_length, cp_size)
    if pose:
        check_pose_length(seq_len, info.original_window)
    with accelerator.main_process_first():  # the first rank fills the token cache for the others
        train_docs = load_documents(cfg["data"], "exclude", tokenizer, cfg["data"]["num_proc"])
        eval_docs = load_documents(cfg["eval"], "include", tokenizer, cfg["data"]["num_proc"]) if cfg["eval"]["every"] else None
    sequences = pack(token_stream(train_docs, tokenizer.eos_token_id), seq_len)
    check_sequences(sequences, seq_len, run["batch_size"], dp_size)
    if eval_docs is not None:
        eval_docs = first_tokens(eval_docs, cfg["eval"]["max_tokens"])
        check_eval_documents(eval_docs, eval_len, cfg["eval"]["max_tokens"])
    targets = lora_targets(model, cfg["lora"]["target_modules"])

    # ---- model
    set_seed(run["seed"])
    model = lora_model(model, cfg, targets)
    attention = AttentionSwitch(model.get_base_model(), run["s2_groups"])
    attention.sparse()
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_total = sum(p.numel() for p in model.parameters())
    optimizer, scheduler = adamw_cosine(model, run["lr"], run["weight_decay"], run["warmup_steps"], run["max_steps"])
    model, optimizer = prepare(accelerator, model, optimizer, run["batch_size"])
    state = TrainingState(accelerator, model, optimizer, scheduler)
    start, evals, history = start_or_resume(state, out, cfg, dp_size, checkpoint)
    if cfg["output"]["log_with"]:
        accelerator.init_trackers("logs", config=tracker_config(cfg))  # under OUT/logs

    # ---- training
    order = DataOrder(len(sequences), run["seed"], run["batch_size"], run["grad_accum"], dp_size)
    tokens_per_step = run["batch_size"] * seq_len * run["grad_accum"] * dp_size
    positions = SkipPositions(seq_len, info.max_length, run["seed"]) if pose else None
    half = cfg["model"]["dtype"] != "float32"
    held_out = HeldOut(accelerator, model, eval_docs, eval_len, attention, evals, half) if eval_docs is not None else None
    if held_out is not None and start == 0:
        held_out(0)  # before the clock starts
    model.train()
    progress = Progress(
        run["max_steps"],
        start,
        tokens_per_step,
        disable=not main,
        desc=f"{info.method} x{info.factor:g} @ {seq_len} ({n_trainable / 1e6:.2f}M of {n_total / 1e6:.1f}M trainable)",
    )
    losses, log_step = RecentLoss(), StepLog(accelerator, history)
    for step in range(start, run["max_steps"]):
        batches = (
            (sequences[order.indices(step, micro, dp_rank)], positions(order.samples(step, micro, dp_rank)) if pose else None)
            for micro in range(run["grad_accum"])
        )
        lr = scheduler.get_last_lr()[0]
        loss = train_step(accelerator, model, optimizer, scheduler, batches, run, cp_size)
        losses.add(loss)
        done = step + 1
        log_step(done, loss, lr, progress.step(done, losses.mean, lr))
        if held_out is not None and (done % cfg["eval"]["every"] == 0 or done == run["max_steps"]):
            with progress.paused():
                held_out(done)
        if cfg["output"]["save_every"] and done % cfg["output"]["save_every"] == 0 and done < run["max_steps"]:
            with progress.paused():
                save_checkpoint(state, out, done, digest, cfg["output"]["keep"], evals, history)
    seconds = progress.close()

    # ---- outputs
    rank_digests = replica_digests(accelerator, model)
    attention.full()
    unwrapped = save_adapter(accelerator, model, out)
    log = {}
    if main:
        log = {
            "config": cfg,
            "base_model": base_record,
            "patch": info.to_dict(),
            "seq_len": seq_len,
            "sequences_available": len(sequences),
            "trainable_params": n_trainable,
            "total_params": n_total,
            "steps": run["max_steps"],
            "resumed_from_step": start,
            "tokens_trained": tokens_per_step * (run["max_steps"] - start),
            "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens_per_step * (run["max_steps"] - start) / seconds),
            "final_loss": round(losses.mean, 5) if losses.values else None,
            "evals": sorted(evals, key=lambda e: e["step"]),
            "history": history,
            "processes": accelerator.num_processes,
            "data_parallel_size": dp_size,
            "distributed_type": accelerator.distributed_type.name,
            "mixed_precision": accelerator.mixed_precision,
            "rank_digests": rank_digests,
        }
        write_outputs(out, log, unwrapped, tokenizer)
        print(f"rope-ext: fine-tune written to {out}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return log


def main(argv: list[str] | None = None) -> dict:
    """recipes/finetune.py's command line: raises ConfigError on a bad setting."""
    cfg, resume = parse_args(argv, description=__doc__.split("\n\n")[0])
    return train(cfg, resume)
