"""A fine-tune's training state on disk: atomic checkpoints of what LoRA training changes, the
run folder's config, and which checkpoint a resumed run continues from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from accelerate.checkpointing import load_accelerator_state, load_custom_state, save_accelerator_state, save_custom_state
from accelerate.utils import DistributedType, load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from .config import ConfigError, config_digest, identity_differences

TRAINED_STATE = "trained_state.safetensors"
# what --resume reads of a run folder's files, checked before the model loads
RUN_CONFIG_FIELDS = {"config": dict, "data_parallel_size": int}
TRAINER_STATE_FIELDS = {"step": int, "config_digest": str, "evals": list, "history": list}


def checkpoint_layout(accelerator) -> str:
    """The files a launch's checkpoints hold: FSDP's and DeepSpeed's own, or those of a replicated
    model (one process or DDP)."""
    return {DistributedType.FSDP: "fsdp", DistributedType.DEEPSPEED: "deepspeed"}.get(accelerator.distributed_type, "replicated")


class TrainingState:
    """What a checkpoint holds: what LoRA training changes (the LoRA weights and the trainable
    embeddings and norms, as peft names them; the optimizer, the LR schedule and every rank's RNG),
    not the frozen base. DeepSpeed is the exception: accelerate hands its checkpoint to the engine's
    save_checkpoint, which writes the whole model (docs/finetune.md)."""

    def __init__(self, accelerator, model, optimizer, scheduler):
        self.accelerator, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.fsdp = accelerator.distributed_type == DistributedType.FSDP
        if not self.fsdp:
            # The scheduler is stepped by the training loop (not prepared), so save_state/load_state
            # carry it as a custom object.
            accelerator.register_for_checkpointing(scheduler)
        if checkpoint_layout(accelerator) == "replicated":
            _keep_trained_weights_only(accelerator)

    def save(self, folder: Path) -> None:
        """Every rank writes its part of the state into `folder`."""
        if not self.fsdp:
            self.accelerator.save_state(str(folder))
            return
        # accelerate's save_state writes an FSDP model whole (save_fsdp_model without adapter_only),
        # before any hook runs. Its own FSDP functions with adapter_only=True write the trained
        # weights alone, in the plugin's state-dict type (SHARDED_STATE_DICT: each rank its shards,
        # through torch.distributed.checkpoint); the rest is what save_state would write.
        accelerator, plugin = self.accelerator, self.accelerator.state.fsdp_plugin
        save_fsdp_model(plugin, accelerator, self.model, str(folder), adapter_only=True)
        save_fsdp_optimizer(plugin, accelerator, self.optimizer.optimizer, self.model, str(folder))
        save_custom_state(self.scheduler, str(folder))
        save_accelerator_state(str(folder), [], [], [], [], accelerator.process_index, accelerator.step, accelerator.scaler)

    def load(self, folder: Path) -> None:
        if not self.fsdp:
            self.accelerator.load_state(str(folder))
            return
        accelerator, plugin = self.accelerator, self.accelerator.state.fsdp_plugin
        load_fsdp_model(plugin, accelerator, self.model, str(folder), adapter_only=True)
        # The torch optimizer inside accelerate's wrapper: loading into a fresh optimizer takes one
        # zero-lr step first, which through the wrapper would go through an fp16 GradScaler that has
        # scaled no loss yet.
        load_fsdp_optimizer(plugin, accelerator, self.optimizer.optimizer, self.model, str(folder))
        load_custom_state(self.scheduler, str(folder))
        # The scaler and this rank's RNG. The step counter it returns is not restored: it counts
        # micro-steps, a multiple of grad_accum at every checkpoint, so a fresh one syncs at the same ones.
        load_accelerator_state(str(folder), [], [], [], [], accelerator.process_index, accelerator.scaler)


def _keep_trained_weights_only(accelerator) -> None:
    """Make accelerate's save_state/load_state write and read only the trained weights of a
    replicated model, not its whole state dict: optimizer, schedule and RNG stay accelerate's."""

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


def save_checkpoint(
    state: TrainingState, out: Path, step: int, digest: str, keep: int, evals: list[dict], history: list[dict]
) -> None:
    """The training state and the evals and per-step log so far, into a temporary folder renamed
    into place only when every rank has finished writing."""
    accelerator = state.accelerator
    root = out / "checkpoints"
    tmp = root / f".step-{step}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    state.save(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        trainer_state = {"step": step, "config_digest": digest, "evals": evals, "history": history}
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
        final = root / f"step-{step}"
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in checkpoints(out)[:-keep] if keep else []:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def read_record(path: Path, fields: dict, hint: str = "") -> dict:
    """The JSON object in `path` with `fields` of their types; ConfigError naming the file and what
    is wrong with it (a file cut short by a stopped run, or edited)."""
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"--resume: {path} is not valid JSON, cut short or edited ({err}){hint}") from None
    bad = [key for key, kind in fields.items() if not isinstance(record, dict) or not isinstance(record.get(key), kind)]
    if bad:
        raise ConfigError(f"--resume: {path} has no valid {', '.join(bad)}: not as a fine-tune run writes it{hint}")
    return record


def check_checkpoint(path: Path, layout: str, out: Path) -> Path:
    """`path`, after checking that its files are whole: its trainer_state.json and, where one
    process or DDP wrote it, the trained weights. A damaged one names the complete checkpoint
    before it, if any."""
    step = path.name.removeprefix("step-")
    earlier = [p for p in checkpoints(out) if step.isdigit() and int(p.name.split("-")[1]) < int(step)]
    hint = f"; resume from the one before it with --resume {earlier[-1]}" if earlier else ""
    read_record(path / "trainer_state.json", TRAINER_STATE_FIELDS, hint)
    if layout == "replicated" and not (path / TRAINED_STATE).is_file():
        raise ConfigError(f"--resume: {path} holds no {TRAINED_STATE} (the trained weights){hint}")
    return path


def find_resume(out: Path, resume: str, cfg: dict, world: int, layout: str) -> Path:
    """The checkpoint to resume from, after checking it belongs to this exact configuration and its
    files are whole."""
    run_config = out / "run_config.json"
    if not run_config.is_file():
        raise ConfigError(f"--resume: {out} is not a fine-tune run folder (no run_config.json)")
    saved = read_record(run_config, RUN_CONFIG_FIELDS)
    differences = identity_differences(cfg, saved["config"])
    if differences:
        raise ConfigError(f"--resume: {out} was trained with another configuration:\n  " + "\n  ".join(differences))
    # run folders written before the layout was recorded all came from one process or DDP
    if saved.get("checkpoint_layout", "replicated") != layout:
        raise ConfigError(
            f"--resume: {out} was checkpointed by a {saved.get('checkpoint_layout', 'replicated')} launch, this one is "
            f"{layout}: their checkpoints hold different files"
        )
    if saved["data_parallel_size"] != world:
        raise ConfigError(
            f"--resume: {out} was trained on {saved['data_parallel_size']} data-parallel rank(s), this launch has {world}; "
            "the data order and batch size depend on it"
        )
    if resume == "latest":
        found = checkpoints(out)
        if not found:
            raise ConfigError(f"--resume: no checkpoint in {out / 'checkpoints'}")
        return check_checkpoint(found[-1], layout, out)
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise ConfigError(f"--resume {path}: not a complete checkpoint folder")
    check_checkpoint(path, layout, out)
    if json.loads((path / "trainer_state.json").read_text())["config_digest"] != config_digest(cfg):
        raise ConfigError(f"--resume {path}: this checkpoint was written by another configuration")
    return path


def checkpoint_to_resume(out: Path, resume: str | None, cfg: dict, world: int, layout: str) -> Path | None:
    """The checkpoint a --resume run continues from; None for a new run, after checking that `out`
    holds no run yet."""
    if resume:
        return find_resume(out, resume, cfg, world, layout)
    if checkpoints(out) or (out / "adapter_model.safetensors").exists():
        raise ConfigError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    return None


def start_or_resume(
    state: TrainingState, out: Path, cfg: dict, world: int, checkpoint: Path | None
) -> tuple[int, list[dict], list[dict]]:
    """(first step, evals so far, per-step log so far): restored from `checkpoint`, or a new run
    folder that records its configuration for a later --resume."""
    accelerator = state.accelerator
    start, evals, history = 0, [], []
    if checkpoint is not None:
        state.load(checkpoint)
        resumed = json.loads((checkpoint / "trainer_state.json").read_text())
        start, evals, history = resumed["step"], resumed["evals"], resumed["history"]
    elif accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "run_config.json").write_text(
            json.dumps(
                {
                    "config": cfg,
                    "config_digest": config_digest(cfg),
                    "data_parallel_size": world,
                    "checkpoint_layout": checkpoint_layout(accelerator),
                },
                indent=2,
                default=str,
            )
            + "\n"
        )
    accelerator.wait_for_everyone()
    return start, evals, history
