"""The shared tier's filesystem: the few calls it makes, over fsspec or Curvine's SDK.

``open_transport`` turns ``KVCACHE_SHARED_URL`` into a ``Transport``: the folder root and
an opener that connects lazily (on the tier's I/O thread, so an unreachable cluster never
stalls start-up). It checks what can be checked without the network: the scheme is
known and its filesystem installed, the Curvine SDK imports, a ``file://`` mount exists;
anything else is a ``ConfigError`` naming the variable. The server calls it at start-up
through ``cache.assembly.validate``, the engine processes when they build their tiers.

- ``curvine://PATH``: a Curvine cluster through its Python SDK (``curvinefs``), set up by
  the cluster's client file (``KVCACHE_CURVINE_CONF``) or, without a file, by the master
  addresses (``KVCACHE_CURVINE_MASTERS``), from which a minimal client file
  (``[client] master_addrs``) is written to a private temporary file while the SDK
  connects. No FUSE mount needed, so it works on plain SageMaker endpoints.
- ``file:///mnt/curvine/PATH``: Curvine mounted as a POSIX path (FUSE, or the CSI
  driver's PVC on HyperPod).
- any other fsspec URL whose filesystem is installed (``memory://``, ``s3://`` ...).

Runs on the shared tier's I/O threads; every call may block on the network.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from cache.errors import ConfigError
from cache.placed import BytesReader, FdReader, FileReader, Reader

T = TypeVar("T")

CURVINE_WRITE_CHUNK = 4 << 20  # the SDK's write buffer size, and bytes copied per call


class FsOps:
    """The calls the shared tier makes, over a filesystem that implements fsspec fully."""

    def __init__(self, fs) -> None:
        self.fs = fs

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def read_with(self, path: str, use: Callable[[Reader], T]) -> T:
        """``use(reader)`` over the file at ``path`` (``cache.placed``'s readers): a
        mount (fsspec's plain local filesystem) is read with ``preadv``, any other
        filesystem through its file object."""
        if type(self.fs).__name__ == "LocalFileSystem":
            fd = os.open(path, os.O_RDONLY)
            try:
                return use(FdReader(fd))
            finally:
                os.close(fd)
        with self.fs.open(path, "rb") as f:
            size = getattr(f, "size", None)
            if size is None:
                size = f.seek(0, os.SEEK_END)
            return use(FileReader(f, int(size)))

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def write(self, path: str, parts: list) -> None:
        with self.fs.open(path, "wb") as f:
            for p in parts:
                f.write(memoryview(p).cast("B"))

    def rename(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst)

    def remove(self, path: str) -> None:
        self.fs.rm_file(path)

    def ls(self, path: str) -> list[dict]:
        try:
            return self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []

    def list_dir(self, folder: str) -> list[tuple[str, int, float]]:
        """``(name, size, mtime)`` of every file directly in ``folder`` (none if it is missing)."""
        return [
            (e["name"].rstrip("/").rsplit("/", 1)[-1], int(e.get("size") or 0), _mtime(e))
            for e in self.ls(folder)
            if e.get("type") != "directory"
        ]

    def list_tree(self, folder: str) -> list[tuple[str, int, float]]:
        """``(name, size, mtime)`` of every file one folder below ``folder``."""
        out = []
        for shard in self.ls(folder):
            if shard.get("type") != "directory":
                continue
            for e in self.ls(shard["name"]):
                if e.get("type") != "directory":
                    out.append((e["name"].rstrip("/").rsplit("/", 1)[-1], int(e.get("size") or 0), _mtime(e)))
        return out


class CurvineOps(FsOps):
    """Curvine's ``CurvineFileSystem`` implements part of fsspec: no ``open(..., "wb")``,
    ``makedirs`` or ``pipe``, and ``exists``/``cat_file`` report an unreachable cluster
    as a missing file. It offers ``create``/``mkdir``/``rename``/``rm`` instead."""

    def exists(self, path: str) -> bool:
        return self.fs.get_file_status(path) is not None

    def size(self, path: str) -> int:
        status = self.fs.get_file_status(path)
        if status is None:
            raise FileNotFoundError(path)
        return int(status["len"])

    def makedirs(self, path: str) -> None:
        try:
            self.fs.mkdir(path, True)
        except OSError:
            if self.fs.get_file_status(path) is None:
                raise

    def write(self, path: str, parts: list) -> None:
        writer = self.fs.create(path, True)
        try:
            for p in parts:
                view = memoryview(p).cast("B")
                for off in range(0, len(view), CURVINE_WRITE_CHUNK):
                    writer.write(bytes(view[off : off + CURVINE_WRITE_CHUNK]))
        finally:
            writer.close()

    def read_with(self, path: str, use: Callable[[Reader], T]) -> T:
        return use(BytesReader(self.read(path)))  # the SDK reads whole files

    def rename(self, src: str, dst: str) -> None:
        self.fs.rename(src, dst)

    def remove(self, path: str) -> None:
        if self.fs.get_file_status(path) is None:
            raise FileNotFoundError(path)
        self.fs.rm(path)


def _mtime(info: dict) -> float:
    """Seconds since the epoch from an fsspec info dict (0 when unknown)."""
    for field in ("mtime", "created", "LastModified", "last_modified"):
        value = info.get(field)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return value.timestamp()
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        return value / 1000 if value > 1e11 else value  # Curvine reports milliseconds
    return 0.0


def ops_for(fs) -> FsOps:
    """The calls the tier makes, over ``fs`` (an fsspec filesystem or Curvine's)."""
    return CurvineOps(fs) if type(fs).__name__ == "CurvineFileSystem" else FsOps(fs)


@dataclass(frozen=True)
class Transport:
    url: str
    root: str  # the tier's folder, as the filesystem names it
    opener: Callable[[], object]  # connects (returns the filesystem); called once,
    # lazily, on an I/O thread


def open_transport(url: str, curvine_conf: str = "", curvine_masters: Sequence[str] = ()) -> Transport:
    """The filesystem ``url`` names. Raises ``ConfigError`` for a URL whose filesystem is
    missing, broken or unknown; never touches the network."""
    if url.startswith("curvine://"):
        return _curvine(url, curvine_conf, tuple(curvine_masters))
    return _fsspec(url)


def curvine_client_toml(masters: Sequence[str]) -> str:
    """A minimal Curvine client file: the master addresses (``host:port``); every other
    client setting keeps Curvine's default."""
    rows = []
    for m in masters:
        host, port = m.rsplit(":", 1)
        rows.append(f'    {{ hostname = "{host}", port = {int(port)} }},')
    return "[client]\nmaster_addrs = [\n" + "\n".join(rows) + "\n]\n"


def _curvine(url: str, conf: str, masters: tuple[str, ...]) -> Transport:
    if not conf and not masters:
        raise ConfigError(
            f"KVCACHE_SHARED_URL={url!r} needs the Curvine cluster: set "
            "KVCACHE_CURVINE_MASTERS (host:port of its masters) or KVCACHE_CURVINE_CONF "
            "(its client configuration file, curvine-cluster.toml)"
        )
    try:
        from curvinefs import CurvineFileSystem
    except Exception as e:  # missing, or broken (stubs from an old protoc raise TypeError)
        raise ConfigError(
            f"KVCACHE_SHARED_URL={url!r} needs Curvine's Python SDK (package curvinefs, built from "
            f"the Curvine sources with maturin), which is missing or broken in this image "
            f"({type(e).__name__}: {e}); install it, or mount Curvine (FUSE/CSI) and use "
            "file:///MOUNT/PATH"
        ) from None
    root = "/" + url[len("curvine://") :].strip("/")

    def connect(path: str):
        return CurvineFileSystem(config_path=path, write_chunk_size=CURVINE_WRITE_CHUNK, write_chunk_num=2)

    if conf:
        return Transport(url, root, lambda: connect(conf))

    def from_masters():
        fd, path = tempfile.mkstemp(prefix="kvcache-curvine-", suffix=".toml")  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(curvine_client_toml(masters))
            return connect(path)  # the SDK reads the file while it connects
        finally:
            os.unlink(path)

    return Transport(url, root, from_masters)


def _fsspec(url: str) -> Transport:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise ConfigError(f"KVCACHE_SHARED_URL={url!r}: the filesystem for this URL is not installed ({e})") from None
    except ValueError as e:
        raise ConfigError(
            f"KVCACHE_SHARED_URL={url!r} is not a URL fsspec knows ({e}); use "
            "curvine://PATH, file:///MOUNT/PATH or another fsspec URL"
        ) from None
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if "file" in protocols or "local" in protocols:
        parent = os.path.dirname(root.rstrip("/")) or "/"
        if not os.path.isdir(parent):
            raise ConfigError(
                f"KVCACHE_SHARED_URL={url!r}: {parent} does not exist; is the shared "
                "volume (Curvine FUSE/CSI mount) mounted there?"
            )
    return Transport(url, root, lambda: fs)
