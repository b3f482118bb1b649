"""A decode step through torch.compile, for the benchmarks (bench/decode.py --compile,
bench/gpu_check.py): what a method's kernels cost once Python and op dispatch leave the step.

The model's forward is compiled whole (`torch.compile(model, dynamic=True)`, inductor, graph
breaks allowed): dynamo traces transformers' decoder and the patch's attention chain, the KV
cache's length symbolic from the first step, so that a growing DynamicCache does not recompile
at every step. What dynamo cannot trace in rope-ext's per-forward state (the kept keys' store, the
checks of the positions) runs eagerly between the compiled graphs, and the count of those breaks
says how much of the step stayed in Python. The first compiled steps pay for compilation, so a
benchmark warms the step up (`warm_up`) before it times it, and states the compile time apart.
A frame whose guards hold a KV cache's identity (rope-ext's per-cache bookkeeping, where dynamo
traces into it) compiles again for each new cache: a benchmark also runs a few untimed compiled
steps on the cache it then times, and counts the frames traced while it timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

# every variant of a benchmark compiles the same transformers code objects, each with its own
# guards, and dynamo falls back to eager past its recompile limit (8 by default) without a word
RECOMPILE_LIMIT = 512
# compiled steps before a benchmark times any: dynamo's first, then two with the cache length dynamic
WARM_STEPS = 3


def compile_step(model: torch.nn.Module) -> Callable:
    """The model's forward through torch.compile, cache length dynamic."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, RECOMPILE_LIMIT * 16)
    return torch.compile(model, dynamic=True)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return counters["stats"]["unique_graphs"]


def compiled_frames() -> int:
    """Frames dynamo has traced in this process so far, each recompilation counted (a frame that
    compiles to Python alone adds no graph)."""
    return counters["frames"]["total"]


def graph_breaks() -> int:
    """Graph breaks dynamo has met in this process so far."""
    return sum(counters["graph_break"].values())


def greedy(forward: Callable, token: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """(last logits [B, V], next token [B, 1]): one greedy decode step of `forward` on `cache`."""
    logits = forward(token, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    return logits, logits.argmax(-1, keepdim=True)


@torch.inference_mode()
def warm_up(model: torch.nn.Module, step: Callable, ids: torch.Tensor, new_cache: Callable, steps: int) -> dict:
    """`steps` decode steps of the compiled `step` after an eager prefill of `ids` on a fresh
    cache (`new_cache(model)`), beside as many eager steps on a second one: the seconds they took
    (compilation, mostly), the graph breaks and graphs dynamo made (those new to the process: a
    graph an earlier variant compiled is not counted again), the largest |compiled - eager| logit
    over the largest |eager| one, whether every greedy token agreed, and the frames dynamo traced
    in the last step (more than 0: the step compiles again at every step). A step that fails to
    compile gives {"error": why}."""
    states = []
    for _ in range(2):
        cache = new_cache(model)
        states.append((cache, model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)))
    (eager_cache, eager_token), (compiled_cache, compiled_token) = states
    breaks, graphs, gap, agree, seconds = graph_breaks(), compiled_graphs(), 0.0, True, 0.0
    for _ in range(steps):
        eager, eager_token = greedy(model, eager_token, eager_cache)
        frames, begin = compiled_frames(), time.perf_counter()
        try:
            compiled, compiled_token = greedy(step, compiled_token, compiled_cache)
        except Exception as error:  # dynamo and inductor raise many types; the benchmark goes on without the step
            return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
        seconds += time.perf_counter() - begin
        gap = max(gap, ((compiled.float() - eager.float()).abs().max() / eager.float().abs().max()).item())
        agree &= bool((compiled_token == eager_token).all())
    return {
        "compile_s": seconds,
        "graph_breaks": graph_breaks() - breaks,
        "graphs": compiled_graphs() - graphs,
        "max_rel_gap": gap,
        "same_tokens": agree,
        "frames_last_step": compiled_frames() - frames,
    }
