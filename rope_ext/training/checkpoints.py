"""A fine-tune's training state on disk: atomic checkpoints, the run folder's config, and which
checkpoint a resumed run continues from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .config import ConfigError, config_digest, identity_differences


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a checkpoint is complete once renamed into place)."""
    root = out / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(accelerator, out: Path, step: int, digest: str, keep: int, evals: list[dict]) -> None:
    """accelerate's full training state (model, optimizer, scheduler, RNG of every rank) into a
    temporary folder, renamed into place only when every rank has finished writing."""
    root = out / "checkpoints"
    tmp = root / f".step-{step}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = {"step": step, "config_digest": digest, "evals": evals}
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
    if checkpoints(out) or (out / "adapter_config.json").exists():
        raise ConfigError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    return None


def start_or_resume(accelerator, out: Path, cfg: dict, world: int, checkpoint: Path | None) -> tuple[int, list[dict]]:
    """(first step, evals so far): restored from `checkpoint`, or a new run folder that records
    its configuration for a later --resume."""
    start, evals = 0, []
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        resumed = json.loads((checkpoint / "trainer_state.json").read_text())
        start, evals = resumed["step"], resumed["evals"]
    elif accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "run_config.json").write_text(json.dumps(
            {"config": cfg, "config_digest": config_digest(cfg), "data_parallel_size": world}, indent=2, default=str
        ) + "\n")
    accelerator.wait_for_everyone()
    return start, evals
