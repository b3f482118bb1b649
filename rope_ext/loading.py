"""Load a model and apply a method from arguments: the room the eval commands, `rope-ext patch`,
`search`, `dpe-probe`, `demo` and the fine-tune's config share. It holds the words a command line
gives for a model (`plain`, the dtypes, `auto`), the argument group that asks for one
(`model_arguments`) and what turns those arguments into a patched model.

The commands' parsers read this module before torch loads (every `--help` answers at once), so it
imports the standard library and `rope_ext.defaults` at the top and the modules that load torch
(the registry, the record, patching, chunked) in the functions that use them."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import rope_ext
from rope_ext.defaults import SMOLLM2 as DEFAULT_MODEL  # the embedded checkpoint, where a name is expected
from rope_ext.defaults import embedded_window

if TYPE_CHECKING:
    from rope_ext.record import Patch

PLAIN = "plain"  # the unpatched model
DTYPES = ("float32", "bfloat16", "float16")
AUTO = "auto"  # bfloat16 where the device computes it natively, else float32 (resolve_dtype)
METHOD_HELP = "a method that `rope-ext methods` lists"


def parse_value(text: str):
    """'4' -> 4, '0.5' -> 0.5, 'true' -> True, 'none' -> None, anything else stays a string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return text.strip()


def parse_params(items: list[str]) -> dict:
    """['beta_fast=16', 'causal=false'] -> {'beta_fast': 16, 'causal': False}."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--param expects KEY=VALUE, got {item!r}")
        params[key.strip()] = parse_value(value)
    return params


def split_items(where: str, text: str) -> list[str]:
    """'a=1,b=[1.0,2.0]' -> ['a=1', 'b=[1.0,2.0]']: a comma inside brackets belongs to a list value
    (longrope's factor lists)."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth != 0:
        raise ValueError(f"{where}: unbalanced brackets in {text!r}")
    return [*items, text[start:]]


def resolve_device(device: str | None) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """`dtype`, with AUTO made bfloat16 where `device` computes it natively (a CPU with AVX512-BF16
    or AMX, a CUDA GPU with bf16), else float32. Long evals in bf16 give the answers of fp32 on
    SmolLM2 (docs/evals.md, "bf16"); without native support bf16 is emulated and slower."""
    import torch

    if dtype != AUTO:
        return dtype
    if device.startswith("cuda"):
        native = torch.cuda.is_bf16_supported()
    else:
        native = any(
            getattr(torch.cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        )
    return "bfloat16" if native else "float32"


def load_model(name: str | None = None, dtype: str = AUTO, device: str | None = None, attn_implementation: str = "sdpa"):
    """(model, tokenizer) in eval mode. `name` None is the embedded SmolLM2; a checkpoint saved
    after `rope_ext.patch` comes back patched (rope_ext.from_pretrained). `dtype` AUTO: see
    resolve_dtype."""
    import torch
    from transformers import AutoTokenizer

    from rope_ext import record

    if dtype not in (AUTO, *DTYPES):
        raise ValueError(f"dtype must be one of {(AUTO, *DTYPES)}, got {dtype!r}")
    device = resolve_device(device)
    torch_dtype = getattr(torch, resolve_dtype(dtype, device))
    if name in (None, DEFAULT_MODEL):
        from rope_ext.defaults import load_smollm2

        model, tokenizer = load_smollm2(dtype=torch_dtype, attn_implementation=attn_implementation)
    elif (Path(name).expanduser() / record.FINETUNE_FILE).is_file():
        model, tokenizer = load_finetuned(Path(name).expanduser(), torch_dtype, attn_implementation)
    else:
        check_model(name, device)
        local = Path(name).expanduser()
        try:
            model = rope_ext.from_pretrained(
                str(local) if local.exists() else name, dtype=torch_dtype, attn_implementation=attn_implementation
            )
            tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else name)
        except OSError as err:
            raise FileNotFoundError(
                f"cannot load model {name!r}: it is not a local checkpoint directory and the hub did not provide it ({err})"
            ) from None
    return model.to(device).eval(), tokenizer


def load_finetuned(folder: Path, dtype, attn_implementation: str):
    """(model, tokenizer) of a LoRA fine-tune folder (the recipe's --out): its base, the patch it
    was trained under and the adapter (rope_ext.load_finetuned), the adapter folded into the
    weights so that the model is a plain patched one to every eval; named after the folder."""
    from transformers import AutoTokenizer

    model = rope_ext.load_finetuned(folder, merge=True, dtype=dtype, attn_implementation=attn_implementation)
    model.config._name_or_path = str(folder.resolve())  # the results name the fine-tune, not its base
    return model, AutoTokenizer.from_pretrained(folder)


def apply_method(
    model,
    method: str = PLAIN,
    factor: float | None = None,
    params: dict | None = None,
    original_window: int | None = None,
    allow_shrink: bool = False,
):
    """Patch the model with `method` (replacing any earlier patch) and return the PatchInfo, over
    `original_window` or, for the embedded SmolLM2, its card's window;
    `plain` removes any patch and returns None; None leaves the model as loaded (a checkpoint
    saved patched keeps its patch: describe_setup records it) and returns None."""
    params = params or {}
    if method is None:
        check_method(method, factor, params, original_window)
        return None
    if method == PLAIN:
        if params or factor is not None:
            raise ValueError("method 'plain' (the unpatched model) takes no --factor or --param")
        if patched(model):
            rope_ext.unpatch(model)
        return None
    window = original_window or embedded_window(model)
    extra = {} if window is None else {"original_window": window}
    return rope_ext.patch(model, method, factor=factor, allow_shrink=allow_shrink, **extra, **params)


def check_method(
    method: str | None, factor: float | None, params: dict | None = None, original_window: int | None = None
) -> None:
    """The checks of a method spec that need no model: the name, the factor and the parameters."""
    from rope_ext import method as registry

    params = params or {}
    if method is None:
        if params or factor is not None or original_window is not None:
            raise ValueError(
                "--factor, --param and --original-window need --method (without it the model is evaluated as loaded)"
            )
        return
    if method == PLAIN:
        if params or factor is not None:
            raise ValueError("method 'plain' (the unpatched model) takes no --factor or --param")
        return
    registry.check(method, factor, params)


def check_model(name: str | None, device: str | None) -> None:
    """--model and --device, checked before anything loads."""
    from rope_ext import record

    if name not in (None, DEFAULT_MODEL):
        local = Path(name).expanduser()
        if (local / record.FINETUNE_FILE).is_file():
            record.read_finetune(local)  # a LoRA fine-tune folder: its record names the base and the patch
        elif local.exists() and not (local / "config.json").is_file():
            raise FileNotFoundError(
                f"--model {name}: {local} holds neither a config.json (a checkpoint directory) nor a "
                f"{record.FINETUNE_FILE} (a fine-tune folder)"
            )
    resolve_device(device)


def saved_patch(name: str | None) -> Patch | None:
    """The patch a local checkpoint (its config.json) or fine-tune folder records, read from its
    files before it loads; None for none."""
    from rope_ext import record

    if name in (None, DEFAULT_MODEL):
        return None
    local = Path(name).expanduser()
    if (local / record.FINETUNE_FILE).is_file():
        return record.read_finetune(local)[1]
    path = local / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"--model {name}: {path} is not valid JSON ({err})") from None
    return record.read(SimpleNamespace(**{record.CONFIG_KEY: config.get(record.CONFIG_KEY)}), str(path))


def patched(model) -> Patch | None:
    """The patch on the model, or None for an unpatched or unsupported model."""
    from rope_ext.patching import installed_patch

    try:
        return installed_patch(model)
    except ValueError:
        return None


def check_chunking(method: str | None, factor, params: dict) -> None:
    """ValueError when the method spec scales an input as a whole, so that --chunk-size cannot
    give its numbers (rope_ext.chunked.chunking_refusal); for a spec check_method passed."""
    from rope_ext import method as registry
    from rope_ext.chunked import chunking_refusal

    if method in (None, PLAIN):
        return
    spec, _, checked = registry.check(method, factor, params)
    reason = chunking_refusal(spec, checked)
    if reason is not None:
        raise ValueError(f"--chunk-size: {reason}")


def model_arguments(parser, *, method: bool = True) -> None:
    """--model/--dtype/--device/--attn-implementation/--chunk-size, and with `method` also
    --method/--factor/--param/--original-window."""
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        metavar="PATH_OR_ID",
        help=f"local checkpoint directory or hub id (default: {DEFAULT_MODEL}, the embedded SmolLM2-135M)",
    )
    group.add_argument(
        "--dtype",
        default=AUTO,
        choices=(AUTO, *DTYPES),
        help="weights and activations dtype; auto: bfloat16 on a CPU with native bf16 dot products "
        "(AVX512-BF16 or AMX) or a CUDA GPU with bf16, else float32; rotary angles stay fp32 "
        "(default: auto; results record the dtype)",
    )
    group.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available, else cpu)")
    group.add_argument("--attn-implementation", default="sdpa", help="transformers attention backend (default: sdpa)")
    group.add_argument(
        "--chunk-size",
        type=int,
        metavar="N",
        help="run each input through the KV cache N tokens at a time (rope_ext.chunked): memory holds "
        "the cache and one chunk; with sink_window the cache keeps only the sinks and the window "
        "(default: one forward per input)",
    )
    if method:
        method_arguments(
            group,
            method=f"{METHOD_HELP}, or plain (unpatched) (default: the model as loaded: a checkpoint saved "
            "patched, or a fine-tune folder, keeps its patch; the embedded SmolLM2 is unpatched)",
            factor="scale relative to the original window (required unless plain)",
            param="extra method parameter, repeatable (e.g. --param beta_fast=16 --param causal=false; a list as "
            "--param long_factor=[1.0,1.5,2.0], as longrope takes)",
        )


def method_arguments(group, *, method: str, factor: str, param: str, window: str = "", required: bool = False) -> None:
    """--method, --factor, --param and --original-window: a method spec as the commands that patch a
    model take it (model_arguments, `rope-ext patch`), each help in the command's words (`window`
    ends --original-window's default)."""
    group.add_argument("--method", required=required, help=method)
    group.add_argument("--factor", type=float, help=factor)
    group.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help=param)
    group.add_argument(
        "--original-window",
        type=int,
        help="the pretraining window: the method replaces the checkpoint's shipped scaling over it (default: the "
        f"patch extends the model as loaded{window})",
    )


def check_model_args(args) -> dict:
    """The method parameters of the arguments model_arguments added, after checking every one of them;
    call it before model_from_args."""
    from rope_ext.method.base import as_size

    params = parse_params(args.param)
    check_method(args.method, args.factor, params, args.original_window)
    if args.original_window is not None:
        as_size(args.original_window, "--original-window")
    if args.chunk_size is not None:
        as_size(args.chunk_size, "--chunk-size")
        check_chunking(args.method, args.factor, params)
    check_model(args.model, args.device)
    return params


def model_from_args(args, params: dict):
    """(model, tokenizer, PatchInfo | None) from the arguments check_model_args checked."""
    model, tokenizer = load_model(args.model, args.dtype, args.device, args.attn_implementation)
    info = apply_method(model, args.method, args.factor, params, args.original_window)
    return model, tokenizer, info
