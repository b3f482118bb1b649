"""lm-evaluation-harness integration: a `rope_ext` model type and a `rope-ext lm-eval` command.

    rope-ext lm-eval --model rope_ext --model_args pretrained=PATH,method=yarn,factor=4 \\
        --tasks rope_ext_passkey,rope_ext_longppl --device cpu

The model type loads a checkpoint like lm-eval's `hf` type, applies `rope_ext.patch` with the
method, factor and method parameters found in model_args (`plain` or no method: unpatched; a
checkpoint saved patched is re-patched as saved), and sets lm-eval's `max_length` to the patch's
max_length, since lm-eval otherwise uses max_position_embeddings and left-truncates longer inputs
without an error. `pretrained=smollm2` (or no pretrained) is the embedded SmolLM2-135M.

`@register_model` only fills lm-eval's in-process registry, so the stock `lm_eval` command never
sees this type (importing this module registers it; run it through `rope-ext lm-eval`, not
`python -m`, which would register it twice): `main` adds the folder of the tasks shipped here
(evals/tasks) to the task search path, and runs lm-eval's own command line. From Python, the same
folder goes to `TaskManager(include_path=TASKS_DIR)`. A built model hands its tokenizer and
max_length to the tasks (lm_eval_tasks.evaluate_with), which build their documents for it while
it lives.

lm-eval's RULER tasks build their prompts with a tokenizer they load themselves, named by the
task metadata's `tokenizer` or `pretrained` key. `main` names the evaluated checkpoint there
(`with_task_tokenizer`) for a rope_ext run, since its `pretrained` may be `smollm2` or absent.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from rope_ext.extras import require

require("eval", "the rope_ext lm-eval model type", ("lm_eval", "datasets"))
import torch  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.utils import handle_arg_string  # noqa: E402

import rope_ext
from rope_ext import loading
from rope_ext import method as registry
from rope_ext.defaults import resolve_checkpoint
from rope_ext.method.base import as_size

from . import lm_eval_tasks

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
log = logging.getLogger(__name__)


class ModelArgsError(ValueError):
    """A --model_args value the rope_ext model type cannot use: `main` prints it as one line."""


def method_parameter_names(method: str) -> set[str]:
    """The parameters `rope_ext.patch` accepts for `method`, besides factor."""
    spec = rope_ext.methods()[method]
    return set(spec["params"]) - {"factor"}


def check_model_args(method: str | None, factor, params: dict) -> float | None:
    """The factor as a number, after the checks that need no model; ModelArgsError names the key."""
    if method in (None, loading.PLAIN):
        if factor is not None:
            raise ModelArgsError(f"model_args factor={factor!r} needs a method=<{'|'.join(rope_ext.methods())}>")
        return None
    if isinstance(factor, str):  # model_args given as text from Python; lm-eval's own parser makes numbers
        factor = loading.parse_value(factor)
    try:
        return registry.check(method, factor, params)[1]
    except ValueError as err:
        raise ModelArgsError(f"model_args: {err}") from None


def check_loading_args(pretrained: str, original_window, max_length, device: str, kwargs: dict) -> None:
    """The model_args that lm-eval's hf type and from_pretrained would take without a word (a
    max_length of 0) or fail on deep inside, after the model loaded (a dtype that is none):
    ModelArgsError naming the key, before anything loads."""
    for key, value in (("original_window", original_window), ("max_length", max_length)):
        if value is not None:
            try:
                as_size(value, f"model_args {key}")
            except ValueError as err:
                raise ModelArgsError(str(err)) from None
    dtype = kwargs.get("dtype")
    if isinstance(dtype, str) and dtype != "auto" and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ModelArgsError(f"model_args dtype={dtype!r} is not a torch dtype (auto, float32, bfloat16, float16, ...)")
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelArgsError(f"model_args device={device!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    batch = kwargs.get("batch_size", 1)
    if not (isinstance(batch, str) and batch.startswith("auto")) and not (str(batch).isdigit() and int(batch) >= 1):
        raise ModelArgsError(f"model_args batch_size={batch!r} must be a whole number >= 1 or auto")
    local = Path(pretrained).expanduser()
    if pretrained.startswith(("/", ".", "~")) and not local.is_dir():  # a hub id starts with none of them
        raise ModelArgsError(f"model_args pretrained={pretrained!r}: no such folder")


def refuse_padded_batches_it_cannot_run(model, batch_size) -> None:
    """ModelArgsError when lm-eval's batches of `batch_size` prompts would reach a patch that runs
    one unpadded sequence only: lm-eval left-pads a generation batch, and the patch would refuse
    it at the first one, mid-run. A two-token padded batch asks the patch itself."""
    if str(batch_size) == "1":
        return
    ids = torch.zeros((2, 2), dtype=torch.long, device=model.device)
    padding = torch.ones_like(ids)
    padding[0, 0] = 0
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=padding)
    except ValueError as err:
        raise ModelArgsError(
            f"model_args batch_size={batch_size}: {err} (lm-eval pads a batch's prompts: use batch_size=1)"
        ) from None


def unknown_key(err: TypeError, method: str | None) -> ModelArgsError | None:
    """The error naming a model_args key that nothing accepted, from the TypeError transformers
    raises when an unused from_pretrained keyword reaches the model's __init__."""
    found = re.search(r"__init__\(\) got an unexpected keyword argument '(\w+)'", str(err))
    if found is None:
        return None
    ours = "method, factor, original_window, max_length"
    if method not in (None, loading.PLAIN):
        ours += f", and {method}'s {', '.join(sorted(method_parameter_names(method))) or 'none'}"
    return ModelArgsError(
        f"model_args key {found.group(1)!r} is not an argument of the rope_ext model type ({ours}), "
        "of lm-eval's hf type or of transformers' from_pretrained"
    )


@register_model("rope_ext")
class RopeExtLM(HFLM):
    """lm-eval's HF causal LM with a rope-ext patch applied after loading."""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """As lm-eval's (the Python route: simple_evaluate with a model_args string), except that a
        comma inside brackets belongs to a list value (longrope's factors), which lm-eval's own
        parser there splits; its command line keeps such a list whole already."""
        args = {}
        for item in loading.split_items("model_args", (arg_string or "").strip()):
            if item:
                key, _, value = item.partition("=")
                args[key] = loading.parse_value(value) if value.lstrip().startswith("[") else handle_arg_string(value)
        return cls(**args, **{k: v for k, v in (additional_config or {}).items() if v is not None})

    def __init__(
        self,
        pretrained=loading.DEFAULT_MODEL,
        method: str | None = None,
        factor: float | None = None,
        original_window: int | None = None,
        max_length: int | None = None,
        device: str | None = None,
        **kwargs,
    ):
        method = method or None
        names = method_parameter_names(method) if method in rope_ext.methods() else set()
        params = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        factor = check_model_args(method, factor, params)
        if device is None or (str(device).startswith("cuda") and not _cuda()):
            device = "cpu"  # lm-eval's default is cuda; a CPU-only machine would fail later, not here
        check_loading_args(str(pretrained or loading.DEFAULT_MODEL), original_window, max_length, device, kwargs)
        path = resolve_checkpoint(pretrained)
        try:
            super().__init__(pretrained=path, device=device, max_length=max_length, **kwargs)
        except TypeError as err:
            named = unknown_key(err, method)
            if named is None:
                raise
            raise named from None
        except ValueError as err:  # transformers' refusal of a setting, e.g. an unknown attn_implementation
            raise ModelArgsError(f"model_args: {err}") from None
        if method is None:  # a checkpoint saved after rope_ext.patch, loaded by transformers alone
            self.patch_info = rope_ext.reapply(self.model, path)
        else:
            self.patch_info = loading.apply_method(self.model, method, factor, params, original_window)
        if max_length is None and self.patch_info is not None:
            self._max_length = self.patch_info.max_length
        refuse_padded_batches_it_cannot_run(self.model, self.batch_size)
        lm_eval_tasks.evaluate_with(self)
        log.info("rope_ext: method=%s factor=%s max_length=%d", method, factor, self.max_length)


def with_task_tokenizer(model_args: dict, metadata: dict) -> dict:
    """`metadata` with `tokenizer` naming the evaluated checkpoint, unless model_args or metadata
    already name a tokenizer. lm-eval hands the tasks model_args | metadata, and RULER's tasks load
    the tokenizer under `tokenizer`, else `pretrained`: the rope_ext type's `smollm2` (or no
    pretrained at all) names no folder a tokenizer loads from."""
    if model_args.get("tokenizer") or metadata.get("tokenizer"):
        return metadata
    return {**metadata, "tokenizer": resolve_checkpoint(model_args.get("pretrained"))}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    """`lm-eval`'s command line with the rope_ext model type registered and evals/tasks on the
    task path (unless --include_path names another folder)."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv != ["run"] and "--include_path" not in argv and not {"-h", "--help"} & set(argv):
        argv += ["--include_path", str(TASKS_DIR)]
    setup_logging()
    cli = HarnessCLI()
    saved_argv = sys.argv
    sys.argv = ["rope-ext lm-eval", *argv]
    try:
        args = cli.parse_args()
        if getattr(args, "model", None) == "rope_ext":
            args.metadata = with_task_tokenizer(args.model_args or {}, args.metadata or {})
        cli.execute(args)
    except (ModelArgsError, lm_eval_tasks.NoModel) as err:
        print(f"rope-ext lm-eval: error: {err}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved_argv
    return 0
