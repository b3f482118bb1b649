"""`rope-ext patch MODEL OUT --method M --factor F`: the checkpoint MODEL patched without loading its
weights. The patch is proved on the checkpoint's small twin (rope_ext.export.twin); OUT gets config.json
(the checkpoint's own with the patch written in), generation_config.json, the tokenizer files with
`model_max_length` = the length the patch is meant for, README.md (a model card with the serving
commands, rope_ext.export.handoff), and the weight files linked (a hard link, else a symbolic one; copied
with --copy-weights), never rewritten. It prints the base, what each reader serves and the commands
(--json: all of it as one object).

MODEL is a local folder, a hub id (its config and tokenizer files through huggingface_hub, the
weights linked where the hub cache holds them, else referenced: OUT/README.md says how to fetch
them), or the embedded SmolLM2's name. OUT is written as OUT.partial and renamed at the end, so a
failure leaves nothing."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

from rope_ext import defaults, record, serving
from rope_ext import method as registry
from rope_ext.export import handoff
from rope_ext.export.twin import patch_twin, read_config
from rope_ext.loading import parse_params
from rope_ext.method.base import as_size

# weight files: linked or copied, never read
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
WEIGHT_INDEX = re.compile(r".*\.(safetensors|bin)\.index\.json$")
TOKENIZER_CONFIG = "tokenizer_config.json"
CARD = "README.md"
# what a hub id's snapshot fetches: everything but the weights
HUB_FILES = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py", "*.md"]
ADAPTER_FILES = ("adapter_config.json", "rope_ext_adapter_config.json")
GGUF = ".gguf"


@dataclass
class Plan:
    params: dict
    folder: Path  # where config.json and the other files are read
    hub_id: str | None  # the checkpoint's hub id, where MODEL named one
    original_window: int | None


def is_weight(path: Path) -> bool:
    return path.suffix in WEIGHT_SUFFIXES or bool(WEIGHT_INDEX.match(path.name))


def looks_like_path(name: str) -> bool:
    """A MODEL that names a file system path rather than a hub id (`owner/name` or `name`)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def check_folder(folder: Path, name: str) -> None:
    """A local MODEL: a checkpoint folder, not a fine-tune's adapter."""
    if (folder / record.FINETUNE_FILE).is_file():
        base, saved = record.read_finetune(folder)
        raise ValueError(
            f"MODEL {name} is a LoRA fine-tune folder (an adapter trained on {base} under {saved.method} "
            f"x{saved.factor:g}), not a checkpoint: its weights are the base's plus the adapter, and a new patch of the "
            "base would leave the adapter on the patch it was trained under. Merge it into a checkpoint first: "
            f"python -c \"import rope_ext; rope_ext.load_finetuned({str(folder)!r}, merge=True).save_pretrained('merged')\""
            " then rope-ext patch merged OUT ..."
        )
    if any((folder / adapter).is_file() for adapter in ADAPTER_FILES) and not (folder / "config.json").is_file():
        raise ValueError(
            f"MODEL {name} is a peft adapter folder, not a checkpoint: merge the adapter into its base "
            "(peft's merge_and_unload, then save_pretrained) and patch that folder"
        )
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"MODEL {name}: {folder} holds no config.json (a checkpoint folder holds one)")

    read_config(folder)  # a model type transformers knows, or the reason no twin can be built


def hub_snapshot(repo: str) -> Path:
    """The config and tokenizer files of hub checkpoint `repo` (the hub, or its cache offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        raise OSError(
            f"MODEL {repo}: the hub cannot be reached and no snapshot of {repo} is cached; run it where the hub is "
            f"reachable, or download it (hf download {repo}) and give the folder"
        ) from None
    except HfHubHTTPError as err:
        raise OSError(f"MODEL {repo}: the hub refused it ({err})") from None


def check(args: argparse.Namespace) -> Plan:
    """The destination, the method spec and MODEL, before anything is written."""
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder; choose a new folder")
    params = parse_params(args.param)
    registry.check(args.method, args.factor, params)
    window = None if args.original_window is None else as_size(args.original_window, "--original-window")
    if args.model in (defaults.SMOLLM2, ""):
        # the embedded model's card states its window, which its config states only as max_position_embeddings
        return Plan(params, defaults.smollm2_path(), None, window or defaults.SMOLLM2_WINDOW)
    if args.model.endswith(GGUF):
        # a GGUF MODEL is patched in place of its rope metadata (issue #49, item 3): routed here
        raise ValueError(f"MODEL {args.model}: GGUF checkpoints are not patched by this command yet")
    local = Path(args.model).expanduser()
    if local.exists():
        check_folder(local, args.model)
        return Plan(params, local, None, window)
    if looks_like_path(args.model):
        raise FileNotFoundError(f"MODEL {args.model}: no such folder ({local.absolute()})")
    folder = hub_snapshot(args.model)
    check_folder(folder, args.model)
    return Plan(params, folder, args.model, window)


def link_or_copy(source: Path, target: Path, copy: bool) -> str:
    """`target` as `source`'s bytes without rewriting them: a hard link, else a symbolic link (across
    file systems); copied with `copy`. Returns which."""
    real = source.resolve()
    if copy:
        shutil.copy2(real, target)
        return "copied"
    try:
        os.link(real, target)
        return "hard-linked"
    except OSError:
        target.symlink_to(real)
        return "symlinked"


def tokenizer_config(source: Path, max_length: int) -> dict:
    config = json.loads(source.read_text(encoding="utf-8"))
    config["model_max_length"] = max_length
    return config


def write_folder(plan: Plan, out: Path, twin, card: str, copy_weights: bool) -> dict:
    """OUT's files from the checkpoint's folder; returns what was done with each kind of file."""
    done = {"weights": {}, "tokenizer_config": False}
    for source in sorted(plan.folder.rglob("*")):
        relative = source.relative_to(plan.folder)
        if source.is_dir() or relative.parts[0].startswith("."):
            continue
        target = out / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if relative.name == "config.json" and len(relative.parts) == 1:
            continue
        if relative.name == CARD and len(relative.parts) == 1:
            continue
        if is_weight(source) and not WEIGHT_INDEX.match(source.name):
            done["weights"][str(relative)] = link_or_copy(source, target, copy_weights)
        elif relative.name == TOKENIZER_CONFIG and len(relative.parts) == 1:
            target.write_text(json.dumps(tokenizer_config(source, twin.info.max_length), indent=2) + "\n")
            done["tokenizer_config"] = True
        else:
            shutil.copy2(source.resolve(), target)
    (out / "config.json").write_text(json.dumps(twin.config, indent=2, sort_keys=True) + "\n")
    (out / CARD).write_text(card)
    return done


def missing_weights(folder: Path) -> list[str]:
    """The weight files a safetensors index names that `folder` does not hold (a hub checkpoint
    whose weights are referenced, not cached)."""
    missing = set()
    for index in folder.glob("*.index.json"):
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing |= {shard for shard in shards if not (folder / shard).exists()}
    if not any(folder.glob("*.index.json")) and not any(is_weight(p) for p in folder.iterdir()):
        missing.add("model.safetensors")
    return sorted(missing)


def base_model(args, plan: Plan) -> str:
    if args.model in (defaults.SMOLLM2, ""):
        return defaults.SMOLLM2_HUB
    return plan.hub_id or Path(args.model).expanduser().resolve().name


def run(args: argparse.Namespace, plan: Plan) -> int:
    with warnings.catch_warnings(record=True) as caught, record.unlisted_keys_quiet():
        warnings.simplefilter("always")
        twin = patch_twin(
            plan.folder,
            args.method,
            args.factor,
            original_window=plan.original_window,
            allow_shrink=args.allow_shrink,
            **plan.params,
        )
        _, original = read_config(plan.folder)
    notes = [str(w.message).removeprefix("rope_ext: ") for w in caught if issubclass(w.category, UserWarning)]
    info = twin.info
    out = Path(args.out)
    source = plan.hub_id or str(plan.folder)

    verdicts = {
        serving.TRANSFORMERS: serving.transformers_verdict(twin.rotary, info.native is not None),
        **serving.verdicts(handoff.holder_of(twin.config), info.patch, twin.rotary, info.native is not None),
    }
    found = handoff.engines(twin, original, str(out), source)
    missing = missing_weights(plan.folder)
    if missing:
        notes.append(
            f"the weights are referenced, not here: fetch them into this folder with "
            f"`hf download {plan.hub_id or source} {' '.join(missing)} --local-dir {out}`"
        )
    card = handoff.model_card(base_model(args, plan), info, verdicts, found, str(out), notes)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        done = write_folder(plan, partial, twin, card, args.copy_weights)
        if out.exists():
            out.rmdir()  # an empty folder, checked before
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    report = {
        "out": str(out),
        "source": source,
        **handoff.summary(info),
        "starts_from": info.starts_from,
        "verdicts": verdicts,
        "engines": found,
        "rope_ext": handoff.rope_ext_load(str(out)),
        "files": {**done, "missing_weights": missing},
        "notes": notes,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print_report(report, found)
    return 0


def print_report(report: dict, found: dict) -> None:
    base = report["starts_from"]
    scaling = f"its shipped {base['scaling']} scaling" if base["scaling"] else "the trained frequencies"
    weights = report["files"]["weights"]
    how = ", ".join(sorted(set(weights.values()))) or "none here"
    tokenizer = (
        f"tokenizer model_max_length {report['max_length']}"
        if report["files"]["tokenizer_config"]
        else "no tokenizer_config.json"
    )
    print(f"{report['method']} x{report['factor']:g}: {scaling} over a {report['window']}-token window ({base['source']}),")
    print(f"meant for {report['max_length']} tokens; wrote {report['out']} (config.json, {tokenizer}, README.md; weights {how})")
    for note in report["notes"]:
        print(f"note: {note}")
    print("what each reader serves from the written config.json:")
    print(serving.table(report["verdicts"]))
    print("commands (also in README.md):")
    for line in handoff.commands(found, report["out"]):
        print(f"  {line}")
