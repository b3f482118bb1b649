"""Where eval results go: a folder per run holding JSON, a markdown table and plots. An existing
result file is never replaced unless the user says --overwrite; the check runs before any
compute, so a forgotten --output costs nothing. Every results file records its provenance
(`provenance`): the software versions, the source's git commit when it runs from a checkout, the
machine settings and the checkpoint. `output_arguments` is the argument group that names the folder;
the commands' parsers read it before torch loads."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

DEFAULT_ROOT = "rope-ext-results"


def output_arguments(parser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--output", metavar="DIR", help=f"folder for the results (default: {DEFAULT_ROOT}/<command>-<time>)")
    group.add_argument("--overwrite", action="store_true", help="replace result files that already exist in --output")
    group.add_argument("--no-progress", action="store_true", help="hide progress bars")


class ResultFolder:
    """The files one run writes. `claim()` fails early when any of them exists; the folder is
    created by the first write, so a run that fails before it leaves nothing behind."""

    def __init__(self, folder: str | Path | None, command: str, names: list[str], overwrite: bool = False):
        if folder is None:
            folder = Path(DEFAULT_ROOT) / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.folder = Path(folder)
        self.names = names
        self.overwrite = overwrite

    def path(self, name: str) -> Path:
        return self.folder / name

    def claim(self) -> "ResultFolder":
        if self.folder.exists() and not self.folder.is_dir():
            raise ValueError(f"--output {self.folder} is a file, not a folder")
        # the folder is made by the first write, after the measurement: where it would go must take files now
        nearest = next(p for p in (self.folder, *self.folder.parents) if p.exists())
        if not nearest.is_dir():
            raise ValueError(f"--output {self.folder}: {nearest} is a file, not a folder")
        try:
            tempfile.TemporaryFile(dir=nearest).close()
        except OSError as err:
            raise ValueError(f"--output {self.folder}: cannot write in {nearest} ({err.strerror or err})") from None
        existing = [n for n in self.names if self.path(n).exists()]
        if existing and not self.overwrite:
            raise FileExistsError(
                f"{self.folder} already holds {', '.join(existing)}; pass --overwrite or choose another --output"
            )
        return self

    def _open(self, name: str, binary: bool = False):
        self.folder.mkdir(parents=True, exist_ok=True)  # only once there is something to write
        mode = ("w" if self.overwrite else "x") + ("b" if binary else "")
        return open(self.path(name), mode, **({} if binary else {"encoding": "utf-8"}))

    def write_json(self, name: str, data) -> Path:
        with self._open(name) as f:
            json.dump(clean_json(data), f, indent=2)
            f.write("\n")
        return self.path(name)

    def write_text(self, name: str, text: str) -> Path:
        with self._open(name) as f:
            f.write(text)
        return self.path(name)

    def save_figure(self, name: str, figure) -> Path:
        with self._open(name, binary=True) as f:
            figure.savefig(f, format="png", dpi=120, bbox_inches="tight")
        return self.path(name)


def clean_json(value):
    """Infinite and NaN floats become None: strict JSON readers reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    return value


def markdown_table(header: list[str], rows: list[list]) -> str:
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            if not math.isfinite(v):
                return "inf" if v > 0 else "nan"
            return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.2f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def config_hash(model_as_given: str | None) -> str:
    """The first 12 hex digits of the sha256 of the checkpoint's config.json, read as JSON and
    dumped with sorted keys and without `transformers_version`.

    It hashes the file, not the loaded model's config, because a patch rewrites that config
    (rope_parameters, max_position_embeddings, the `rope_ext` record): the same checkpoint hashes
    the same whatever ran on it, patched or not. `transformers_version` names the library that
    wrote the file, not the model, so a checkpoint re-saved by another version keeps its hash."""
    from transformers.utils import cached_file

    from rope_ext.defaults import resolve_checkpoint
    from rope_ext.record import FINETUNE_FILE, read_finetune

    name = resolve_checkpoint(model_as_given)
    local = Path(name).expanduser()  # loading expands ~ too
    if (local / FINETUNE_FILE).is_file():  # a LoRA fine-tune folder: the config is its base's
        return config_hash(read_finetune(local)[0])
    path = local / "config.json" if local.is_dir() else Path(cached_file(name, "config.json"))
    config = json.loads(path.read_text(encoding="utf-8"))
    config.pop("transformers_version", None)
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def checkout_state(root: Path) -> dict:
    """{"git_commit", "git_dirty"} of the git checkout at `root`, {} where there is none or no git.

    Dirty means a tracked file differs from the commit: untracked files (results being written,
    a virtual environment) do not change what ran."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30).stdout

    if not (root / ".git").exists():  # a folder for a checkout, a file for a worktree
        return {}
    try:
        commit = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": commit, "git_dirty": dirty}


def source_root() -> Path:
    """The folder holding the `rope_ext` package: the checkout for an editable install, the
    site-packages folder (no checkout, so no commit) for an installed one."""
    import rope_ext

    return Path(rope_ext.__file__).resolve().parents[1]


def provenance(model, model_as_given: str | None) -> dict:
    """What a results file records about where its numbers come from. Called when the
    measurement starts, so `date` (UTC) and `threads` are those of the run.

    model: the loaded model (its first parameter gives device and dtype). model_as_given: the
    path or hub id the user passed, None for the embedded SmolLM2."""
    import torch
    import transformers

    import rope_ext
    from rope_ext.defaults import SMOLLM2

    parameter = next(model.parameters())
    return {
        "rope_ext": rope_ext.__version__,
        **checkout_state(source_root()),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device": str(parameter.device),
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": model_as_given or SMOLLM2,
        "config_sha256": config_hash(model_as_given),
    }


def provenance_line(record: dict) -> str:
    """The one line a markdown results file gives its provenance."""
    source = ""
    if "git_commit" in record:
        source = f" (git {record['git_commit'][:12]}{', uncommitted changes' if record['git_dirty'] else ''})"
    return (
        f"Provenance: rope-ext {record['rope_ext']}{source}, transformers {record['transformers']}, torch {record['torch']}; "
        f"{record['device']}, {record['dtype']}, {record['threads']} thread(s); {record['date']}; "
        f"model {record['model']} (config sha256 {record['config_sha256']}).\n"
    )


def write_measurement(path: Path, results: dict) -> None:
    """A bench's results as JSON at `path`, which must not exist: a measurement is never replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "x") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")
