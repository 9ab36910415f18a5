#!/usr/bin/env bash
# Builds Curvine's Python SDK wheel (curvinefs + the native curvine_libsdk) from a Curvine
# source tree, as Curvine's build/build.sh does, with one difference: the protobuf stubs
# come from the protoc that grpcio-tools ships, chosen to match the protobuf the image runs
# (the distribution's protoc is 3.12 on Ubuntu 22.04, whose stubs fail to import under
# protobuf 4.21+). Both images run it in their curvine-builder stage.
#
#   bash docker/curvine_sdk.sh stubs SRC       stubs into SRC's Python SDK, and its protobuf pin
#   bash docker/curvine_sdk.sh wheel SRC OUT   stubs, then the wheel (maturin) into OUT
#
# PROTOBUF_VERSION  the protobuf the image runs (default: the one python3 here has; if it
#                   has none, the newest, as the image's own install will resolve it)
# PROTOC_PYTHON     a Python that already has grpc_tools (default: a throwaway venv with
#                   grpcio-tools matching PROTOBUF_VERSION)
#
# The SDK pins "protobuf>=3.19,<6", which would pull the image's protobuf below what
# googleapis-common-protos needs. The pin is replaced by what the stubs really need:
# protobuf >= their gencode version, same major version.
set -euo pipefail

usage() { echo "usage: bash docker/curvine_sdk.sh stubs SRC | wheel SRC OUT" >&2; exit 2; }

protoc_python() {   # $1: the runtime protobuf version, or empty
    local runtime="$1"
    if [[ -n "${PROTOC_PYTHON:-}" ]]; then
        echo "$PROTOC_PYTHON"
        return
    fi
    local venv
    venv="$(mktemp -d)/protoc"
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --no-input -q --disable-pip-version-check grpcio-tools \
        ${runtime:+"protobuf==$runtime"} >&2
    echo "$venv/bin/python"
}

stubs() {
    local src="$1"
    local proto="$src/crates/common/curvine-proto/proto"
    local out="$src/curvine-libsdk/python/curvine_libsdk/_proto"
    local pyproject="$src/crates/sdk/curvine-libsdk-python/pyproject.toml"
    local runtime
    runtime="${PROTOBUF_VERSION:-$(python3 -c 'import google.protobuf as p; print(p.__version__)' 2>/dev/null || true)}"
    local py
    py="$(protoc_python "$runtime")"
    echo "curvine_sdk.sh: $("$py" -m grpc_tools.protoc --version) (grpcio-tools), runtime protobuf ${runtime:-newest}"
    mkdir -p "$out"
    rm -f "$out"/*_pb2.py
    "$py" -m grpc_tools.protoc -I"$proto" --python_out="$out" "$proto"/*.proto
    # The stubs import each other as top-level modules; inside the package they are siblings.
    sed -i -E 's/^import ([A-Za-z0-9_]+_pb2)( as .*)$/from . import \1\2/' "$out"/*_pb2.py
    local pin
    pin="$("$py" - "$out" "$runtime" <<'PY'
import pathlib, re, sys
out, runtime = pathlib.Path(sys.argv[1]), sys.argv[2]
found = {re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
                   p.read_text()) for p in out.glob("*_pb2.py")}
if not found or None in found:
    sys.exit(f"curvine_sdk.sh: stubs in {out} carry no gencode version: protoc too old")
(gencode,) = {tuple(int(x) for x in m.groups()) for m in found}
if runtime:
    have = tuple(int(x) for x in re.findall(r"\d+", runtime)[:3])
    if gencode[0] != have[0] or gencode > have:
        sys.exit(f"curvine_sdk.sh: stubs of protobuf {'.'.join(map(str, gencode))} do not run "
                 f"on protobuf {runtime}: set PROTOBUF_VERSION to the image's protobuf")
print(f"protobuf>={'.'.join(map(str, gencode))},<{gencode[0] + 1}")
PY
)"
    grep -q '"protobuf[^"]*"' "$pyproject" || { echo "curvine_sdk.sh: no protobuf pin in $pyproject" >&2; exit 1; }
    sed -i -E "s/\"protobuf[^\"]*\"/\"$pin\"/" "$pyproject"
    echo "curvine_sdk.sh: $(ls "$out"/*_pb2.py | wc -l) stub modules; the SDK now requires $pin"
}

wheel() {
    local src="$1" out="$2"
    stubs "$src"
    (cd "$src/crates/sdk/curvine-libsdk-python" \
        && maturin build --release --no-default-features --features extension-module \
            --interpreter python3 --compatibility linux --auditwheel skip --out "$out")
}

case "${1:-}" in
    stubs) [[ $# -eq 2 ]] || usage; stubs "$2" ;;
    wheel) [[ $# -eq 3 ]] || usage; wheel "$2" "$(realpath -m "$3")" ;;
    *) usage ;;
esac
