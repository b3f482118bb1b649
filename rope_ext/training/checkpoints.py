"""A fine-tune's training state on disk: atomic checkpoints of what LoRA training changes, the
run folder's config, and which checkpoint a resumed run continues from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from .config import ConfigError, config_digest, identity_differences
from .distributed import is_sharded

TRAINED_STATE = "trained_state.safetensors"


def keep_trained_state_only(accelerator) -> None:
    """Make accelerate's save_state/load_state write and read only the weights training changes
    (the LoRA weights and the trainable embeddings and norms, as peft names them), not the frozen
    base: optimizer, schedule and RNG stay accelerate's. FSDP and DeepSpeed save their sharded
    state themselves, before these hooks run, so their checkpoints keep the whole model."""
    if is_sharded(accelerator):
        return

    def save(models, weights, output_dir):
        (model,) = models  # the recipe prepares one model
        weights.clear()
        if accelerator.is_main_process:
            state = get_peft_model_state_dict(accelerator.unwrap_model(model))
            # tied trained embeddings share storage with the head, which safetensors refuses
            save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, Path(output_dir) / TRAINED_STATE)

    def load(models, input_dir):
        (model,) = models
        result = set_peft_model_state_dict(accelerator.unwrap_model(model), load_file(Path(input_dir) / TRAINED_STATE))
        if result.unexpected_keys:
            raise ValueError(f"{input_dir}: the checkpoint holds weights this model does not train: {result.unexpected_keys}")
        models.clear()

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a checkpoint is complete once renamed into place)."""
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(accelerator, out: Path, step: int, digest: str, keep: int, evals: list[dict], history: list[dict]) -> None:
    """accelerate's training state (trained weights, optimizer, scheduler, RNG of every rank) and
    the evals and per-step log so far, into a temporary folder renamed into place only when every
    rank has finished writing."""
    root = out / "checkpoints"
    tmp = root / f".step-{step}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = {"step": step, "config_digest": digest, "evals": evals, "history": history}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
        final = root / f"step-{step}"
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in checkpoints(out)[:-keep] if keep else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def find_resume(out: Path, resume: str, cfg: dict, world: int) -> Path:
    """The checkpoint to resume from, after checking it belongs to this exact configuration."""
    run_config = out / "run_config.json"
    if not run_config.is_file():
        raise ConfigError(f"--resume: {out} is not a fine-tune run folder (no run_config.json)")
    saved = json.loads(run_config.read_text())
    differences = identity_differences(cfg, saved["config"])
    if differences:
        raise ConfigError(f"--resume: {out} was trained with another configuration:\n  " + "\n  ".join(differences))
    if saved["data_parallel_size"] != world:
        raise ConfigError(
            f"--resume: {out} was trained on {saved['data_parallel_size']} data-parallel rank(s), this launch has {world}; "
            "the data order and batch size depend on it"
        )
    if resume == "latest":
        found = checkpoints(out)
        if not found:
            raise ConfigError(f"--resume: no checkpoint in {out / 'checkpoints'}")
        return found[-1]
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise ConfigError(f"--resume {path}: not a complete checkpoint folder")
    if json.loads((path / "trainer_state.json").read_text())["config_digest"] != config_digest(cfg):
        raise ConfigError(f"--resume {path}: this checkpoint was written by another configuration")
    return path


def checkpoint_to_resume(out: Path, resume: str | None, cfg: dict, world: int) -> Path | None:
    """The checkpoint a --resume run continues from; None for a new run, after checking that `out`
    holds no run yet."""
    if resume:
        return find_resume(out, resume, cfg, world)
    if checkpoints(out) or (out / "adapter_model.safetensors").exists():
        raise ConfigError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    return None


def start_or_resume(accelerator, out: Path, cfg: dict, world: int, checkpoint: Path | None) -> tuple[int, list[dict], list[dict]]:
    """(first step, evals so far, per-step log so far): restored from `checkpoint`, or a new run
    folder that records its configuration for a later --resume."""
    start, evals, history = 0, [], []
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        resumed = json.loads((checkpoint / "trainer_state.json").read_text())
        start, evals, history = resumed["step"], resumed["evals"], resumed["history"]
    elif accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "run_config.json").write_text(json.dumps(
            {"config": cfg, "config_digest": config_digest(cfg), "data_parallel_size": world}, indent=2, default=str
        ) + "\n")
    accelerator.wait_for_everyone()
    return start, evals, history
