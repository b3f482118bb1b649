"""The GPU check: rope-ext on CUDA in one command, at most 8 minutes on one H200-class GPU.

(a) Exactness. Every registered method, patched at --factor on a small random Llama (norm weights
    moved off 1, so that a rotation that does not commute with a norm shows), over a prompt of
    four windows: its CUDA logits against the same patch's CPU fp32 logits, in fp32 and in bf16,
    and on CUDA in fp32 each of a few decode steps against the full forward. Every call of
    rope_ext.attention.attend_with_lse on CUDA is counted: a fused kernel must take each, none may
    build explicit scores. Tolerances (TOLERANCES): fp32 within 1e-4 of the largest reference logit
    (kernels that sum in another order, nothing more); bf16 within three times the error the same
    patch has in bf16 on the CPU (or plain RoPE has there, if larger): the GPU path adds no error
    beyond bf16's own.
(b) Speed. A random model of Llama-3.2-1B's shapes in bf16, at its pretraining window of 8192 (the
    shipped llama3 scaling left out, so that every method acts from 8192 on) and the factor that
    reaches the longest --lengths: one prefill of each length with the KV cache the patch would
    use (rope_ext.chunked.new_cache: sink_window's bounded cache, else a DynamicCache; the logits
    of the last token only), then --new-tokens greedy decode steps, against the unpatched model on
    torch's sdpa, which runs first and again last at each length: ratios are to the faster of its
    two runs. Each variant runs at its defaults (`dynamic` at its default granularity, 1/8 of the
    window) and is warmed up once at the window plus 1024 tokens first. A run whose prefill,
    predicted from the variant's last one by its growth with the length (Budget.refusal), would not
    fit in what is left of --budget-s, is skipped and says so.
(c) Memory: the peak of torch's CUDA allocator over each run's prefill and decode, and the KV
    cache's bytes after the prefill, with their ratios to plain's.
(d) Decode kernels: at batch 1 a decode step is bound by the host (Python and launches), so its
    wall time says little about attention. After the timed steps, KERNEL_STEPS more steps run under
    torch.profiler, and the device time of every kernel they launch is summed (on the CPU of the
    dry run, the ops' own CPU time): the step as the kernels cost it, without the host.
(e) Compiled decode: the same steps through torch.compile (rope_ext.evals.compiled: the model's
    forward compiled whole, inductor, the cache length dynamic, graph breaks allowed; a CUDA graph
    cannot hold a DynamicCache that grows at every step). Each variant is compiled once, at its
    warm-up, with WARM_STEPS compiled steps beside as many eager ones on a second prefill: the
    compile seconds, the graph breaks and graphs dynamo made for it (new to the process: plain
    compiles first), and the compiled logits' largest gap to the eager ones, over the largest eager
    logit, are reported apart. At each length, after the profiled steps, WARM_STEPS untimed
    compiled steps (a frame whose guards hold the cache's identity compiles again for a new cache),
    then --new-tokens timed ones: their median, its ratio to plain's, and the frames dynamo traced
    while they were timed. Compilation counts toward --budget-s, and all of it together is held
    to --compile-budget-s, so that it leaves the prefills their time: a variant whose compile
    would take longer than what is left of either (predicted by the longest compile so far)
    decodes eagerly only, and says so; so does one that compiles again at every step (frames
    traced in its last warm-up step: each timed step would pay a compilation), and one that fails
    to compile states the error. The dry run compiles only
    DRY_RUN_COMPILED (a method whose patch breaks the graph takes a minute or more to compile on
    the CPU), and says so for the others.
(f) The targets of issue #53 (TARGETS), checked on the runs: dynamic's prefill, the two-part
    methods' prefill and peak, sink_window's prefill and KV cache at the longest length, each
    method's decode kernels against plain's, and each method's compiled decode against plain's at
    the longest length.

The results go to --out as JSON (written after every run, so that a check stopped early keeps what
it measured) with their provenance, and as tables on stdout. --dry-run runs everything on the CPU
at toy sizes (the suite runs it); docs/gpu.md says how to bring the project and the wheels it
needs to a GPU machine without network.

    python bench/gpu_check.py --out docs/results/gpu-check.json
    python bench/gpu_check.py --dry-run --out /tmp/gpu-dry-run.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import rope_ext
from rope_ext.attention import parts
from rope_ext.chunked import new_cache
from rope_ext.evals.compare import parse_specs
from rope_ext.evals.compiled import WARM_STEPS, compile_step, compiled_frames, greedy, warm_up
from rope_ext.evals.output import checkout_state, markdown_table, source_root
from rope_ext.method import REGISTRY

PLAIN = "plain"
# plain once more after the methods at each length: a first run that pays for what the process does
# once (kernel loading, allocator growth) shows as a gap between the two
PLAIN_AGAIN = "plain (again)"
# (a)'s model: small enough for the CPU reference, with grouped key heads and several layers
SMALL = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rope_theta=10000.0,
)
# meta-llama/Llama-3.2-1B, config.json as published on the Hugging Face hub; its rope_scaling
# (llama3, factor 32 from original_max_position_embeddings 8192) is left out and the window is the
# 8192 it states as original
LLAMA_32_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
TOY = dict(SMALL, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, head_dim=16)
# what a method needs beyond --factor to be patched: longrope's per-pair factors (a rising ramp,
# so that each pair differs) and ntk_alpha's alpha
EXTRA = {
    "ntk_alpha": lambda pairs, factor: {"alpha": factor},
    "longrope": lambda pairs, factor: {
        "long_factor": torch.linspace(1.0, factor, pairs).tolist(),
        "short_factor": torch.linspace(1.0, 1.25, pairs).tolist(),
    },
}
TOLERANCES = {"fp32_of_largest_logit": 1e-4, "bf16_over_cpu_bf16": 3.0}
SPEED = ["plain", "yarn", "dynamic", "self_extend", "rerope", "string", "dpe", "dca", "sink_window"]
DECODE_CHECK_STEPS = 4
KERNEL_STEPS = 2
# what the dry run compiles: plain and a static method, whose steps compile to one graph in seconds
DRY_RUN_COMPILED = (PLAIN, PLAIN_AGAIN, "yarn")
TWO_PART = ("self_extend", "rerope", "string", "dpe", "dca")
# issue #53's targets, each (what, variants, measure, bound, at): `measure` of each variant at most
# `bound` (prefill and peak against plain's; the KV cache against its bound; decode kernel time
# against plain's and compiled decode time against compiled plain's, so 1 / 0.9 is 0.9x plain's tokens
# per second), at the longest length or at every one
TARGETS = [
    ("dynamic prefill", ("dynamic",), "prefill_vs_plain", 1.5, "every"),
    ("two-part prefill", TWO_PART, "prefill_vs_plain", 1.25, "longest"),
    ("two-part peak memory", TWO_PART, "peak_vs_plain", 1.1, "longest"),
    ("sink_window prefill", ("sink_window",), "prefill_vs_plain", 1.0, "longest"),
    ("sink_window KV cache", ("sink_window",), "kv_vs_bound", 1.0, "longest"),
    ("decode kernels", tuple(v for v in SPEED if v != PLAIN), "decode_kernel_vs_plain", 1 / 0.9, "every"),
    ("decode compiled", tuple(v for v in SPEED if v != PLAIN), "decode_compiled_vs_plain", 1 / 0.9, "longest"),
]


def random_llama(shape: dict, seed: int = 0, device="cpu") -> LlamaForCausalLM:
    """A random Llama of `shape` on sdpa, its norm weights drawn from [0.5, 1.5]."""
    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.data.uniform_(0.5, 1.5)
    return model


def method_params(name: str, model, factor: float) -> dict:
    pairs = model.config.head_dim // 2
    return EXTRA[name](pairs, factor) if name in EXTRA else {}


class KernelCount:
    """Counts the calls of attend_with_lse's kernel on one device type and of the explicit-score
    path while installed (a context manager)."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.fused = self.scores = 0

    def __enter__(self):
        self._fused, self._scores = parts.FUSED[self.device_type], parts.attend_with_lse_by_scores

        def fused(*args, **kwargs):
            self.fused += 1
            return self._fused(*args, **kwargs)

        def scores(*args, **kwargs):
            self.scores += 1
            return self._scores(*args, **kwargs)

        parts.FUSED[self.device_type], parts.attend_with_lse_by_scores = fused, scores
        return self

    def __exit__(self, *exc):
        parts.FUSED[self.device_type], parts.attend_with_lse_by_scores = self._fused, self._scores


def patched_copy(model, name: str, factor: float, device, dtype):
    twin = copy.deepcopy(model).to(device=device, dtype=dtype)
    rope_ext.patch(twin, name, factor=factor, **method_params(name, model, factor))
    return twin


@torch.inference_mode()
def logits(model, ids) -> torch.Tensor:
    return model(ids.to(model.device)).logits.float().cpu()


@torch.inference_mode()
def decode_gap(model, ids, steps: int) -> float:
    """Largest |decode logits - full-forward logits| over `steps` decode steps after a prefill of
    the rest of `ids`."""
    ids = ids.to(model.device)
    full = model(ids).logits.float()
    cache = DynamicCache(config=model.config)
    model(ids[:, :-steps], cache=cache, use_cache=True)
    gap = 0.0
    for at in range(ids.shape[1] - steps, ids.shape[1]):
        step = model(ids[:, at : at + 1], cache=cache, use_cache=True).logits.float()[:, -1]
        gap = max(gap, (step - full[:, at]).abs().max().item())
    return gap


def exactness(device: torch.device, shape: dict, factor: float) -> dict:
    """(a): {method: {errors, kernel counts, passed}} for every registered method."""
    base = random_llama(shape)
    window = shape["max_position_embeddings"]
    ids = torch.randint(shape["vocab_size"], (1, 4 * window + 5), generator=torch.Generator().manual_seed(1))
    plain_bf16 = (logits(copy.deepcopy(base).to(torch.bfloat16), ids) - logits(base, ids)).abs().max().item()
    results = {}
    for name in tqdm(sorted(REGISTRY), desc="(a) exactness"):
        try:
            reference = logits(patched_copy(base, name, factor, "cpu", torch.float32), ids)
            cpu_bf16 = (logits(patched_copy(base, name, factor, "cpu", torch.bfloat16), ids) - reference).abs().max().item()
            with KernelCount(device.type) as count:
                fp32_model = patched_copy(base, name, factor, device, torch.float32)
                fp32 = (logits(fp32_model, ids) - reference).abs().max().item()
                decode = decode_gap(fp32_model, ids, DECODE_CHECK_STEPS)
                del fp32_model
                bf16 = (logits(patched_copy(base, name, factor, device, torch.bfloat16), ids) - reference).abs().max().item()
        except (ValueError, RuntimeError) as error:
            results[name] = {"error": f"{type(error).__name__}: {error}", "passed": False}
            continue
        scale = reference.abs().max().item()
        fp32_limit = TOLERANCES["fp32_of_largest_logit"] * max(1.0, scale)
        bf16_limit = TOLERANCES["bf16_over_cpu_bf16"] * max(cpu_bf16, plain_bf16)
        results[name] = {
            "largest_logit": scale,
            "fp32_max_abs": fp32,
            "decode_fp32_max_abs": decode,
            "bf16_max_abs": bf16,
            "cpu_bf16_max_abs": cpu_bf16,
            "plain_cpu_bf16_max_abs": plain_bf16,
            "fused_calls": count.fused,
            "explicit_score_calls": count.scores,
            "passed": fp32 <= fp32_limit and decode <= fp32_limit and bf16 <= bf16_limit and count.scores == 0,
        }
    return results


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_bytes(cache) -> int:
    """The bytes of the keys and values a KV cache holds."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


def kernel_ms(model, token, cache, steps: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """(milliseconds per step, the last token): `steps` greedy steps under torch.profiler, as the
    summed device time of the kernels they launch (on the CPU: the ops' own CPU time)."""
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            token = model(token, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        synchronize(device)
    field = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return sum(getattr(event, field) for event in prof.key_averages()) / 1e3 / steps, token


def compiled_ms(step, token, cache, steps: int, device: torch.device) -> dict:
    """WARM_STEPS untimed greedy steps of the compiled `step`, then `steps` timed ones: their median
    milliseconds and the frames dynamo traced while they ran."""
    for _ in range(WARM_STEPS):
        token = greedy(step, token, cache)[1]
    frames, times = compiled_frames(), []
    for _ in range(steps):
        begin = time.perf_counter()
        token = greedy(step, token, cache)[1]
        synchronize(device)
        times.append(time.perf_counter() - begin)
    return {"decode_compiled_ms": 1e3 * statistics.median(times), "frames_compiled_while_timed": compiled_frames() - frames}


@torch.inference_mode()
def timed_run(model, ids, new_tokens: int, device: torch.device, step=None) -> dict:
    """One prefill of `ids` with a fresh KV cache (the patch's, rope_ext.chunked.new_cache), then
    `new_tokens` greedy steps and KERNEL_STEPS profiled ones: seconds, decode milliseconds per token
    (median step) and the kernels' milliseconds per step, peak GiB of the CUDA allocator, GiB of the
    KV cache after the prefill; with a compiled `step`, its steps after those (compiled_ms)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    cache = new_cache(model)
    synchronize(device)
    begin = time.perf_counter()
    token = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    synchronize(device)
    prefill = time.perf_counter() - begin
    kv = cache_bytes(cache) / 2**30
    steps = []
    for _ in range(new_tokens):
        begin = time.perf_counter()
        token = model(token, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        synchronize(device)
        steps.append(time.perf_counter() - begin)
    kernels, token = kernel_ms(model, token, cache, KERNEL_STEPS, device)
    compiled = {} if step is None else compiled_ms(step, token, cache, new_tokens, device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {
        **compiled,
        "prefill_s": prefill,
        "decode_ms": 1e3 * statistics.median(steps),
        "decode_kernel_ms": kernels,
        "peak_gib": peak,
        "kv_gib": kv,
    }


class Budget:
    """What is left of (b)'s seconds, and each variant's last prefill (length, seconds) to predict
    the next one from."""

    def __init__(self, seconds: float, compile_seconds: float, window: int):
        self.end = time.perf_counter() + seconds
        self.compile_end = min(self.end, time.perf_counter() + compile_seconds)
        self.window = window
        self.last: dict[str, tuple[int, float]] = {}
        self.compiled: dict[str, dict] = {}  # each variant's compile warm-up (rope_ext.evals.compiled.warm_up)

    def compile_refusal(self) -> str | None:
        """Why compiling a variant would not fit what is left of the budget and of the compile
        budget, or None: it is predicted to take as long as the longest compile so far."""
        longest = max((c.get("compile_s", 0.0) for c in self.compiled.values()), default=0.0)
        left = self.compile_end - time.perf_counter()
        if left > longest:
            return None
        return (
            f"compiling predicted to take {longest:.0f} s (the longest so far); {max(left, 0):.0f} s of the budget and "
            "the compile budget left"
        )

    def refusal(self, label: str, length: int) -> str | None:
        """Why a prefill of `length` would not fit, or None. The prediction scales the last prefill
        by the square of the length, or, where larger, by the rows past the window times the
        length: the cost of the causal schedule (`dynamic`), one scaling per row past the window,
        each against its whole key prefix."""
        if label not in self.last:
            return None
        done, seconds = self.last[label]
        growth = max((length / done) ** 2, (length - self.window) * length / ((done - self.window) * done))
        predicted, left = seconds * growth, self.end - time.perf_counter()
        if predicted <= left:
            return None
        return (
            f"predicted prefill {predicted:.0f} s from {seconds:.2f} s at {done} tokens; {max(left, 0):.0f} s of the budget left"
        )


def measure(model, label: str, ids, warm, new_tokens: int, device, budget: Budget, step) -> dict:
    """One variant at one length, warmed up first where it has not run yet, and its decode step
    compiled then (`step`, the model's compiled forward; None: not compiled in the dry run)."""
    first = label not in budget.last
    if first:
        budget.last[label] = (warm.shape[1], timed_run(model, warm, 1, device)["prefill_s"])
    reason = budget.refusal(label, ids.shape[1])
    if reason:
        return {"skipped": reason}
    if first:
        if step is None:
            budget.compiled[label] = {
                "skipped": "not compiled in the dry run (a patch that breaks the graph takes minutes to compile on the CPU)"
            }
        else:
            refusal = budget.compile_refusal()
            budget.compiled[label] = {"skipped": refusal} if refusal else warm_up(model, step, warm, new_cache, WARM_STEPS)
    compiled = budget.compiled[label]
    if compiled.get("frames_last_step"):
        compiled.setdefault(
            "skipped", f"compiles again at every step ({compiled['frames_last_step']} frames in the last warm-up step)"
        )
    run = timed_run(model, ids, new_tokens, device, step if "compile_s" in compiled and "skipped" not in compiled else None)
    budget.last[label] = (ids.shape[1], run["prefill_s"])
    return {**run, "compiled": compiled}


def speed(
    device: torch.device, shape: dict, lengths: list[int], new_tokens: int, seconds: tuple[float, float], write, compiled=None
) -> list:
    """(b) to (e): one record per (variant, length), plain first and last at each length (PLAIN_AGAIN),
    each with its ratios to plain's faster run; `write(runs)` after each; `seconds`: the budget and
    the compile budget. Each variant's decode is compiled too, or only those `compiled` names."""
    window = shape["max_position_embeddings"]
    factor = max(lengths) / window
    model = random_llama(shape, device=device).to(torch.bfloat16)
    ids = torch.randint(shape["vocab_size"], (1, max(lengths)), generator=torch.Generator().manual_seed(2)).to(device)
    warm = ids[:, : window + min(window, 1024)]
    budget, runs, step = Budget(*seconds, window), [], compile_step(model)
    for length in lengths:
        at_length = []
        for label, name, params in tqdm(parse_specs(SPEED, []) + [(PLAIN_AGAIN, PLAIN, {})], desc=f"(b) {length} tokens"):
            record = {"variant": label, "length": length, "factor": None if name == PLAIN else factor}
            reason = budget.refusal(label, length)
            if reason:
                record["skipped"] = reason
            else:
                if name != PLAIN:
                    record["params"] = rope_ext.patch(model, name, factor=factor, **params).params
                    if name == "sink_window":
                        record["kv_bound_gib"] = kv_bound(model, record["params"])
                chosen = step if compiled is None or label in compiled else None
                try:
                    record.update(measure(model, label, ids[:, :length], warm, new_tokens, device, budget, chosen))
                except RuntimeError as error:  # a kernel's refusal or the GPU's memory: the other runs still count
                    record["error"] = f"{type(error).__name__}: {error}"
                    budget.last.pop(label, None)
                finally:
                    if name != PLAIN:
                        rope_ext.unpatch(model)
            at_length.append(record)
            runs.append(record)
            write(runs)
        plain = [r for r in at_length if r["variant"] in (PLAIN, PLAIN_AGAIN) and "prefill_s" in r]
        if plain:
            for record in at_length:
                for key in ("prefill_s", "decode_ms", "decode_kernel_ms", "decode_compiled_ms", "peak_gib", "kv_gib"):
                    measured = [r[key] for r in plain if r.get(key) is not None]
                    fastest = min(measured) if measured else None
                    if record.get(key) is not None and fastest:
                        record[f"{key.rsplit('_', 1)[0]}_vs_plain"] = record[key] / fastest
        for record in at_length:
            if "kv_bound_gib" in record and "kv_gib" in record:
                record["kv_vs_bound"] = record["kv_gib"] / record["kv_bound_gib"]
        write(runs)
    return runs


def kv_bound(model, params: dict) -> float:
    """GiB of a KV cache of sinks + window keys and values in every layer: what sink_window keeps."""
    config = model.config
    keys = (params["sinks"] + params["window"]) * config.num_key_value_heads * config.head_dim
    return 2 * config.num_hidden_layers * keys * model.dtype.itemsize / 2**30


def targets(runs: list) -> list:
    """TARGETS checked on `runs`: one record per target and variant, with the measured values (at
    the longest length, or at every length) and whether each is within the bound; a target with no
    measurement (a skipped run, no CUDA allocator on the CPU) says so."""
    longest = max((r["length"] for r in runs), default=None)
    checks = []
    for what, variants, measure, bound, at in TARGETS:
        for variant in variants:
            chosen = [r for r in runs if r["variant"] == variant and (at == "every" or r["length"] == longest)]
            values = {r["length"]: r[measure] for r in chosen if r.get(measure) is not None}
            checks.append(
                {
                    "target": what,
                    "variant": variant,
                    "measure": measure,
                    "bound": bound,
                    "values": values,
                    "met": all(v <= bound for v in values.values()) if values else None,
                }
            )
    return checks


def provenance(device: torch.device, commit: str | None) -> dict:
    # a copy sent to another machine may carry a .git of another commit than its files: the commit
    # the caller names wins
    state = {"git_commit": commit} if commit else checkout_state(source_root()) or checkout_state(Path.cwd())
    return {
        "rope_ext": rope_ext.__version__,
        **state,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def cell(value) -> str:
    """A number as the tables show it: errors need their exponent, times three digits."""
    if isinstance(value, float):
        return f"{value:.2e}" if abs(value) < 0.01 and value else f"{value:.3g}"
    return "" if value is None else str(value)


def tables(results: dict) -> str:
    exact = results.get("exactness", {})
    lines = []
    if exact:
        lines.append(
            markdown_table(
                ["method", "fp32 max|d|", "decode fp32", "bf16 max|d|", "cpu bf16", "fused calls", "score calls", "passed"],
                [
                    [name]
                    + [
                        cell(r.get(key))
                        for key in (
                            "fp32_max_abs",
                            "decode_fp32_max_abs",
                            "bf16_max_abs",
                            "cpu_bf16_max_abs",
                            "fused_calls",
                            "explicit_score_calls",
                        )
                    ]
                    + [r.get("error", r["passed"])]
                    for name, r in exact.items()
                ],
            )
        )
    runs = results.get("speed", [])
    if runs:
        lines.append(
            markdown_table(
                [
                    "variant",
                    "length",
                    "prefill s",
                    "x plain",
                    "decode ms/token",
                    "x plain",
                    "decode kernels ms",
                    "x plain",
                    "decode compiled ms",
                    "x plain",
                    "peak GiB",
                    "x plain",
                    "KV GiB",
                    "skipped",
                ],
                [
                    [r["variant"], r["length"]]
                    + [
                        cell(r.get(key))
                        for key in (
                            "prefill_s",
                            "prefill_vs_plain",
                            "decode_ms",
                            "decode_vs_plain",
                            "decode_kernel_ms",
                            "decode_kernel_vs_plain",
                            "decode_compiled_ms",
                            "decode_compiled_vs_plain",
                            "peak_gib",
                            "peak_vs_plain",
                            "kv_gib",
                        )
                    ]
                    + [r.get("skipped", r.get("error", ""))]
                    for r in runs
                ],
            )
        )
    compiles = {r["variant"]: r["compiled"] for r in runs if "compiled" in r}
    if compiles:
        keys = ("compile_s", "graph_breaks", "graphs", "max_rel_gap", "same_tokens")
        lines.append(
            markdown_table(
                ["variant", "compile s", "graph breaks", "graphs", "compiled max|d| / max|logit|", "same tokens", "not compiled"],
                [
                    [variant] + [cell(c.get(key)) for key in keys] + [c.get("skipped", c.get("error", ""))]
                    for variant, c in compiles.items()
                ],
            )
        )
    checks = results.get("targets", [])
    if checks:
        lines.append(
            markdown_table(
                ["target", "variant", "measure", "at most", "measured", "met"],
                [
                    [c["target"], c["variant"], c["measure"], cell(c["bound"])]
                    + [
                        ", ".join(f"{n}: {cell(v)}" for n, v in c["values"].items()),
                        "not measured" if c["met"] is None else c["met"],
                    ]
                    for c in checks
                ],
            )
        )
    return "\n\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="everything on the CPU at toy sizes")
    parser.add_argument("--out", type=Path, required=True, help="the results JSON (replaced as the check goes)")
    parser.add_argument("--lengths", type=int, nargs="+", help="prefill lengths of (b) (default 32768 131072)")
    parser.add_argument("--new-tokens", type=int, default=16, help="decode steps after each prefill")
    parser.add_argument("--factor", type=float, default=4.0, help="the factor of (a)")
    parser.add_argument("--budget-s", type=float, default=330.0, help="seconds (b) may take")
    parser.add_argument(
        "--compile-budget-s", type=float, default=120.0, help="seconds of --budget-s that compiling the decode steps may take"
    )
    parser.add_argument("--commit", help="the git commit of the files run (a copy of a checkout may hold another's .git)")
    parser.add_argument("--skip-speed", action="store_true", help="(a) only")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, small = torch.device("cpu"), dict(TOY, max_position_embeddings=64)
        big = small
        lengths = args.lengths or [160, 320]
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on a GPU, or pass --dry-run")
        device, small, big = torch.device("cuda"), SMALL, LLAMA_32_1B
        lengths = args.lengths or [32768, 131072]
    if min(lengths) <= big["max_position_embeddings"] + 1024 and not args.dry_run:
        parser.error(f"--lengths must be past the window plus the warm-up ({big['max_position_embeddings'] + 1024})")
    begin = time.perf_counter()
    results = {"provenance": provenance(device, args.commit), "tolerances": TOLERANCES, "dry_run": args.dry_run}

    def write(runs=None) -> None:
        if runs is not None:
            results["speed"] = runs
        results["wall_s"] = time.perf_counter() - begin
        args.out.parent.mkdir(parents=True, exist_ok=True)
        partial = args.out.with_suffix(".partial")
        partial.write_text(json.dumps(results, indent=2))
        os.replace(partial, args.out)

    results["exactness_model"] = small
    results["exactness"] = exactness(device, small, args.factor)
    write()
    print(tables(results), flush=True)
    if not args.skip_speed:
        results["speed_model"] = {"shape": big, "window": big["max_position_embeddings"], "dtype": "bfloat16"}
        compiled = DRY_RUN_COMPILED if args.dry_run else None
        write(speed(device, big, lengths, args.new_tokens, (args.budget_s, args.compile_budget_s), write, compiled))
        results["targets"] = targets(results["speed"])
        write()
        print(tables({"speed": results["speed"], "targets": results["targets"]}))
    print(f"wrote {args.out} ({results['wall_s']:.0f} s)")
    return 0 if all(r["passed"] for r in results["exactness"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
