"""Fail the image build unless Curvine's Python SDK works in this Python.

Runs at image build time (``docker/install.sh`` calls it after installing a Curvine
wheel) and in the tests. It imports ``curvinefs`` (which loads the native library and the
generated protobuf modules) and then calls into every generated module: each message type
is built, serialized and parsed back, so stubs from a protoc that does not match the
runtime protobuf fail here, at build time, instead of at the first request.

    python docker/check_curvine_sdk.py               # the whole SDK (in the images)
    python docker/check_curvine_sdk.py --stubs-only  # only curvine_libsdk._proto (tests)

Exit 0 and one line saying what was checked, or exit 1 and one line saying why not.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from types import ModuleType

STUBS = "curvine_libsdk._proto"


def check_stubs() -> tuple[int, int]:
    """Import every ``*_pb2`` module of the SDK and round-trip each message type through
    its wire format; returns (modules, message types)."""
    package = importlib.import_module(STUBS)
    modules: list[ModuleType] = [
        importlib.import_module(f"{STUBS}.{info.name}")
        for info in pkgutil.iter_modules(package.__path__)
        if info.name.endswith("_pb2")
    ]
    if not modules:
        raise ImportError(f"{STUBS} holds no generated *_pb2 modules")
    messages = 0
    for module in modules:
        for name in module.DESCRIPTOR.message_types_by_name:
            cls = getattr(module, name)
            cls.FromString(cls().SerializePartialToString())
            messages += 1
    return len(modules), messages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stubs-only", action="store_true", help="check the generated modules without importing curvinefs"
    )
    args = parser.parse_args(argv)
    try:
        if not args.stubs_only:
            from curvinefs import CurvineFileSystem  # noqa: F401  (native library + stubs)
        modules, messages = check_stubs()
        from google.protobuf import __version__ as protobuf_version
    except Exception as e:  # any failure is the same verdict: the SDK does not work here
        print(
            f"check_curvine_sdk: Curvine's Python SDK does not work in {sys.executable}: {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return 1
    what = "generated modules" if args.stubs_only else "curvinefs and its generated modules"
    print(
        f"check_curvine_sdk: {what} ok: {modules} modules, {messages} message types "
        f"round-tripped under protobuf {protobuf_version}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
