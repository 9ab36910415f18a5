"""Command line: what each tier holds, whether every entry is sound, and repairs::

    python -m cache.tools.inspect [--verify] [--repair] [--tier dram|disk|shared] [--json]

Settings come from the ``KVCACHE_*`` environment, as the server reads them
(``cache.config.build_cache_config``); tiers are built by ``cache.assembly``. Without a
flag it lists each tier's namespaces (one per model, layout and rank) with their
entries, bytes and ages, and how many of those entries are pinned (``cache.pins``); the
tier that keeps the pin records (the last local one) lists each live pin: its chunks,
tokens, bytes, expiry, and the bytes pinned against ``KVCACHE_PIN_MAX``.

``--verify`` reads every entry and checks it as a server would before serving it (header,
namespace, key, payload length and checksum, and the signature when
``KVCACHE_SIGNING_KEY`` is set), finds orphans (temporary files of writers that are gone,
files that are no entry, entries in the wrong folder) and compares a local tier's byte
account (``ROOT/.usage``) with what its folder holds. It says what ``--repair`` would do
and exits 1 if anything is wrong.

``--repair`` does it, safely while servers use the folders: each removal happens under
the folder lock the tiers use (``FileTier.discard``) and only if the file is still the
one that was checked; temporary files of live writers are never touched; the account is
recounted under the lock (``FileTier.scan``), so it agrees with the folder at that
instant. On the shared tier it removes only what no node could use (a damaged header or
payload), never an entry signed with another key, and leaves temporary files to the
servers' own clean-up (another node's writer cannot be seen from here).

Reads whole entries: on a large tier ``--verify`` takes as long as reading it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

from cache.assembly import build_tiers, pin_book, shared_tier
from cache.codec import CorruptEntry, UnsignedEntry, decode
from cache.config import CacheConfig, TierSpec, build_cache_config
from cache.errors import ConfigError
from cache.pins import pinned_bytes
from cache.sizes import human_bytes
from cache.tiers.files import FileTier, is_debris
from cache.tiers.layout import TMP_MARK, folder_usage, is_key, parse_temp
from cache.tiers.transport import open_transport, ops_for


@dataclass
class Problem:
    path: str
    what: str  # damaged, unsigned, orphan, writing
    detail: str
    inode: int = 0
    key: str = ""


@dataclass
class Namespace:
    tier: str
    namespace: str
    entries: int = 0
    bytes: int = 0
    oldest_s: Optional[float] = None  # age of the oldest entry, seconds
    newest_s: Optional[float] = None
    pins: int = 0  # entries pinned now (cache.pins)
    checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    def saw(self, size: int, mtime: float, now: float) -> None:
        self.entries += 1
        self.bytes += size
        age = max(0.0, now - mtime)
        self.oldest_s = age if self.oldest_s is None else max(self.oldest_s, age)
        self.newest_s = age if self.newest_s is None else min(self.newest_s, age)


@dataclass
class TierReport:
    tier: str
    location: str
    capacity: Optional[int]
    namespaces: list[Namespace] = field(default_factory=list)
    usage_file: Optional[int] = None  # ROOT/.usage (local tiers)
    counted: Optional[int] = None  # what the folder holds against the capacity
    problems: list[Problem] = field(default_factory=list)  # outside any namespace
    repaired: list[str] = field(default_factory=list)
    pin_records: list[dict] = field(default_factory=list)  # live pins (the last local tier)
    pinned_bytes: Optional[int] = None
    pin_limit: Optional[int] = None

    def all_problems(self) -> list[Problem]:
        return self.problems + [p for ns in self.namespaces for p in ns.problems]

    def account_off(self) -> bool:
        return self.usage_file is not None and self.counted is not None and self.usage_file != self.counted


def check_entry(raw, ns_id: str, key: str, signing_key: bytes) -> Optional[tuple[str, str]]:
    """``(what, detail)`` of what is wrong with an entry, None when it would be served."""
    try:
        decode(raw, bytes.fromhex(ns_id), key, signing_key)
    except UnsignedEntry as e:
        return "unsigned", str(e)
    except CorruptEntry as e:
        return "damaged", str(e)
    return None


# -- local tiers ---------------------------------------------------------------------
def inspect_local(config: CacheConfig, spec: TierSpec, verify: bool, now: float) -> TierReport:
    rep = TierReport(spec.name, spec.location, spec.capacity, usage_file=folder_usage(spec.location))
    if not os.path.isdir(spec.location):
        return rep
    book = pin_book(config)
    live = book.live() if book is not None else []
    if spec.last_local and book is not None:
        rep.pin_records = [
            {
                "namespaces": list(p.namespaces),
                "chunks": len(p.keys),
                "tokens": p.tokens,
                "bytes": pinned_bytes([p]),
                "expires_in_s": round(p.expires - now, 1),
            }
            for p in live
        ]
        rep.pinned_bytes, rep.pin_limit = pinned_bytes(live), book.limit
    pinned = {(ns, k) for p in live for ns, k in p.pairs()}
    counted = 0
    for ns in sorted(os.scandir(spec.location), key=lambda e: e.name):
        if not ns.is_dir():
            continue
        if not is_key(ns.name):
            rep.problems.append(Problem(ns.path, "foreign", "not a namespace folder of this cache (left alone)"))
            continue
        report = Namespace(spec.name, ns.name)
        rep.namespaces.append(report)
        for shard in os.scandir(ns.path):
            if not shard.is_dir():
                report.problems.append(
                    Problem(shard.path, "orphan", "a file outside any shard folder", _inode(shard.path))
                )
                continue
            for f in os.scandir(shard.path):
                counted += _local_file(config, report, shard.name, f, verify, now)
                report.pins += (ns.name, f.name) in pinned
    rep.counted = counted
    return rep


def _local_file(config, report: Namespace, shard: str, f: os.DirEntry, verify: bool, now: float) -> int:
    """Account one file of a shard folder; returns the bytes it holds against the capacity."""
    try:
        st = f.stat()
    except FileNotFoundError:
        return 0
    if TMP_MARK in f.name:
        if is_debris(f.name, st.st_mtime):
            report.problems.append(Problem(f.path, "orphan", "temporary file of a writer that is gone", st.st_ino))
            return 0
        return (parse_temp(f.name) or ("", -1, st.st_size))[2]  # a write in progress
    if not is_key(f.name) or f.name[:2] != shard:
        report.problems.append(Problem(f.path, "orphan", "not an entry of this folder", st.st_ino))
        return st.st_size
    report.saw(st.st_size, st.st_mtime, now)
    if verify:
        report.checked += 1
        with open(f.path, "rb") as fh:
            bad = check_entry(fh.read(), report.namespace, f.name, config.signing_key.encode())
        if bad:
            report.problems.append(Problem(f.path, *bad, st.st_ino, f.name))
    return st.st_size


def _inode(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return 0


def repair_local(config: CacheConfig, spec: TierSpec, rep: TierReport) -> None:
    for ns in rep.namespaces:
        tier = _file_tier(config, spec, ns.namespace)
        for p in ns.problems:
            if p.what in ("damaged", "unsigned", "orphan") and tier.discard(p.path, p.inode):
                rep.repaired.append(f"removed {p.what} {p.path}")
    if rep.namespaces:
        before = folder_usage(spec.location)
        list(_file_tier(config, spec, rep.namespaces[0].namespace).scan())  # recount under the lock
        after = folder_usage(spec.location)
        if before != after:
            rep.repaired.append(f"account {before:,} -> {after:,} bytes")


def _file_tier(config: CacheConfig, spec: TierSpec, namespace: str) -> FileTier:
    return next(t for t in build_tiers(config, namespace) if isinstance(t, FileTier) and t.name == spec.name)


# -- the shared tier -----------------------------------------------------------------
def inspect_shared(config: CacheConfig, verify: bool, now: float) -> TierReport:
    transport = open_transport(config.shared_url, config.curvine_conf, config.curvine_masters)
    ops = ops_for(transport.opener())
    root = transport.root.rstrip("/")
    rep = TierReport("shared", config.shared_url, None)
    for ns in sorted(ops.ls(root), key=lambda e: e["name"]):
        name = ns["name"].rstrip("/").rsplit("/", 1)[-1]
        if ns.get("type") != "directory" or not is_key(name):
            continue
        report = Namespace("shared", name)
        rep.namespaces.append(report)
        for fname, size, mtime in ops.list_tree(f"{root}/{name}"):
            path = f"{root}/{name}/{fname[:2]}/{fname}"
            if TMP_MARK in fname:
                if mtime and now - mtime > 3600:
                    report.problems.append(
                        Problem(path, "orphan", "temporary file older than an hour (left to the servers' clean-up)")
                    )
                continue
            if not is_key(fname):
                continue
            report.saw(size, mtime or now, now)
            if verify:
                report.checked += 1
                bad = check_entry(ops.read(path), name, fname, config.signing_key.encode())
                if bad:
                    report.problems.append(Problem(path, *bad, key=fname))
    return rep


def repair_shared(config: CacheConfig, rep: TierReport) -> None:
    for ns in rep.namespaces:
        tier = shared_tier(config, ns.namespace)
        try:
            for p in ns.problems:
                if p.what == "damaged" and tier.delete(p.key):
                    rep.repaired.append(f"removed damaged {p.path}")
        finally:
            tier.close()


# -- the command line -----------------------------------------------------------------
def _age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _would(p: Problem, shared: bool) -> str:
    if p.what in ("writing", "foreign") or (shared and p.what != "damaged"):
        return "left alone"
    return "remove"


def render(reports: list[TierReport], verify: bool, repair: bool) -> str:
    lines = [f"{'tier':<7}{'namespace':<34}{'entries':>9}{'bytes':>14}{'oldest':>9}{'newest':>9}{'pins':>6}"]
    for rep in reports:
        for ns in rep.namespaces:
            lines.append(
                f"{rep.tier:<7}{ns.namespace:<34}{ns.entries:>9,}{ns.bytes:>14,}"
                f"{_age(ns.oldest_s):>9}{_age(ns.newest_s):>9}{ns.pins if ns.pins else '-':>6}"
            )
        if not rep.namespaces:
            lines.append(f"{rep.tier:<7}{'(empty)':<34}")
    for rep in reports:
        where = f"{rep.tier} ({rep.location}"
        where += f", capacity {human_bytes(rep.capacity)})" if rep.capacity else ")"
        lines.append("")
        lines.append(where)
        if rep.usage_file is not None:
            lines.append(
                f"  account (.usage) {rep.usage_file:,} bytes; the folder holds {rep.counted or 0:,}"
                + ("" if not rep.account_off() else "  MISMATCH")
            )
        if verify:
            checked = sum(ns.checked for ns in rep.namespaces)
            bad = rep.all_problems()
            lines.append(f"  {checked:,} entries checked, {len(bad)} problem(s)")
            for p in bad:
                lines.append(f"  {p.what:<9} {p.path}: {p.detail} -> {_would(p, rep.tier == 'shared')}")
            if rep.account_off() and not repair:
                lines.append(f"  account would be recounted: {rep.usage_file:,} -> {rep.counted:,} bytes")
        if rep.pin_limit is not None:
            lines.append(
                f"  pins: {len(rep.pin_records)} live, {rep.pinned_bytes:,} bytes pinned of "
                f"{rep.pin_limit:,} allowed (KVCACHE_PIN_MAX)"
            )
            for pin in rep.pin_records:
                lines.append(
                    f"    {pin['chunks']} chunks ({pin['tokens']:,} tokens, {pin['bytes']:,} bytes), expires "
                    f"in {_age(pin['expires_in_s'])}, namespace {', '.join(pin['namespaces'])}"
                )
        for r in rep.repaired:
            lines.append(f"  repaired: {r}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cache.tools.inspect", description=__doc__.split("::")[0])
    p.add_argument("--verify", action="store_true", help="check every entry and the byte accounts")
    p.add_argument(
        "--repair",
        action="store_true",
        help="verify, then remove what is damaged or orphaned and recount the accounts (safe while servers run)",
    )
    p.add_argument(
        "--tier",
        choices=("dram", "disk", "shared"),
        action="append",
        help="only this tier (repeatable; default: every enabled tier)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    verify = args.verify or args.repair
    try:
        config = build_cache_config()
    except ConfigError as e:
        print(f"configuration error: {e}", file=sys.stderr)
        return 2
    now = time.time()
    reports = []
    for spec in config.tiers():
        if args.tier and spec.name not in args.tier:
            continue
        rep = inspect_shared(config, verify, now) if spec.shared else inspect_local(config, spec, verify, now)
        if args.repair:
            repair_shared(config, rep) if spec.shared else repair_local(config, spec, rep)
        reports.append(rep)
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
    else:
        print(render(reports, verify, args.repair))
    broken = any(r.all_problems() or r.account_off() for r in reports)
    return 1 if verify and broken and not args.repair else 0


if __name__ == "__main__":
    sys.exit(main())
