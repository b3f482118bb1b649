"""`rope-ext env`: what a bug report needs."""

from __future__ import annotations

import argparse
import platform
from importlib import metadata

HELP = "versions, device, bf16 support and threads, for bug reports"
RUNS = __name__
PACKAGES = ("rope-ext", "torch", "transformers", "peft", "accelerate", "lm-eval")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No arguments."""


def check(args: argparse.Namespace) -> None:
    """Nothing to check."""


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def run(args: argparse.Namespace, plan: None = None) -> int:
    """What a bug report needs: package versions, the device and its bf16 support, threads."""
    import torch

    for package in PACKAGES:
        print(f"{package:13} {version(package)}")
    print(f"{'python':13} {platform.python_version()} ({platform.platform()})")
    print(f"{'threads':13} {torch.get_num_threads()} (torch intra-op)")
    cpu = torch.backends.cpu.get_cpu_capability()
    bf16 = torch.cpu._is_avx512_bf16_supported() if hasattr(torch.cpu, "_is_avx512_bf16_supported") else "unknown"
    amx = torch.cpu._is_amx_tile_supported() if hasattr(torch.cpu, "_is_amx_tile_supported") else "unknown"
    print(f"{'cpu':13} {platform.processor() or platform.machine()}, {cpu}; avx512-bf16: {bf16}, amx: {amx}")
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            print(f"{f'cuda:{index}':13} {torch.cuda.get_device_name(index)}, bf16: {torch.cuda.is_bf16_supported()}")
    else:
        print(f"{'cuda':13} not available")
    return 0
