#!/usr/bin/env bash
# Creates .venv and installs fxpipe (editable) with its dev extras, once.
# Sourced by tools/test and tools/demo; safe to run again (it only does missing work).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "fxpipe setup: creating $venv" >&2
    "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"

# The graphviz `dot` binary renders partition graphs; fxpipe degrades without it.
if ! command -v dot >/dev/null 2>&1; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        echo "fxpipe setup: installing graphviz (dot)" >&2
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null) \
            || echo "fxpipe setup: could not install graphviz; rendering will write .dot files only" >&2
    else
        echo "fxpipe setup: graphviz 'dot' not found; install it (apt-get install graphviz) to render PNG/SVG" >&2
    fi
fi

stamp="$venv/.fxpipe-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    # Torch first, pinned to a CPU-friendly release unless the caller chooses another:
    # an unpinned `torch` resolves to a multi-GB CUDA build on Linux.
    if ! "$vpy" -c "import torch" >/dev/null 2>&1; then
        echo "fxpipe setup: installing ${FXPIPE_TORCH_SPEC:-torch==2.13.0}" >&2
        "$vpy" -m pip install -q "${FXPIPE_TORCH_SPEC:-torch==2.13.0}"
    fi
    echo "fxpipe setup: installing fxpipe[dev] (editable)" >&2
    "$vpy" -m pip install -q -e "$root[dev]"
    touch "$stamp"
fi
