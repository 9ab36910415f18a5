"""TinyLFU's frequency history: how often a key was seen lately, in a few bytes per key.

Runs under the store's lock with the policy that owns it; every call is O(1) (eight
byte probes). The one periodic pass halves every counter (C-level ``bytes.translate``)
once every ``period`` additions: amortized O(1). Keys are non-negative integers,
mixed here; the sketch keeps no reference to them.
"""

from __future__ import annotations

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_HALVE = bytes(v >> 1 for v in range(256))  # translate table: halve every counter


class FrequencySketch:
    """TinyLFU frequency history: doorkeeper Bloom filter + count-min sketch.

    The first sighting of a key only sets its two doorkeeper bits; later sightings bump
    four saturating byte counters (conservative update). Estimate = counters + door.
    Every ``period`` additions all counters are halved and the doorkeeper is cleared
    (``resets`` counts those; they are the policy's ageing epochs). Indexes use
    multiply-shift range reduction, so ``width`` need not be a power of two.
    """

    def __init__(self, width: int, period: int) -> None:
        w = max(64, width)
        self.w = w
        self.table = bytearray(4 * w)
        self.door = bytearray(4 * w)  # 32 doorkeeper bits per counter column
        self.dbits = 32 * w
        self.period = max(1, period)
        self.count = 0
        self.resets = 0

    def estimate(self, h: int) -> int:
        h = (h * 0x9E3779B97F4A7C15) & _M64
        h ^= h >> 29
        w, t = self.w, self.table
        g = (h * 0xD6E8FEB86659FD93) & _M64
        m = t[((h & _M32) * w) >> 32]
        x = t[w + (((h >> 32) * w) >> 32)]
        if x < m:
            m = x
        x = t[2 * w + (((g & _M32) * w) >> 32)]
        if x < m:
            m = x
        x = t[3 * w + (((g >> 32) * w) >> 32)]
        if x < m:
            m = x
        d, db = self.door, self.dbits
        g = (h * 0x165667B19E3779F9) & _M64
        b0 = ((g & _M32) * db) >> 32
        b1 = ((g >> 32) * db) >> 32
        if d[b0 >> 3] & (1 << (b0 & 7)) and d[b1 >> 3] & (1 << (b1 & 7)):
            m += 1
        return m

    def add(self, h: int) -> int:
        """Count one access of ``h``; returns the new estimate."""
        h = (h * 0x9E3779B97F4A7C15) & _M64
        h ^= h >> 29
        d, db = self.door, self.dbits
        g = (h * 0x165667B19E3779F9) & _M64
        b0 = ((g & _M32) * db) >> 32
        b1 = ((g >> 32) * db) >> 32
        w, t = self.w, self.table
        g = (h * 0xD6E8FEB86659FD93) & _M64
        i0 = ((h & _M32) * w) >> 32
        i1 = w + (((h >> 32) * w) >> 32)
        i2 = 2 * w + (((g & _M32) * w) >> 32)
        i3 = 3 * w + (((g >> 32) * w) >> 32)
        m = t[i0]
        x = t[i1]
        if x < m:
            m = x
        x = t[i2]
        if x < m:
            m = x
        x = t[i3]
        if x < m:
            m = x
        if d[b0 >> 3] & (1 << (b0 & 7)) and d[b1 >> 3] & (1 << (b1 & 7)):
            if m < 255:
                for i in (i0, i1, i2, i3):
                    if t[i] == m:
                        t[i] = m + 1
                m += 1
        else:
            d[b0 >> 3] |= 1 << (b0 & 7)
            d[b1 >> 3] |= 1 << (b1 & 7)
        self.count += 1
        if self.count >= self.period:
            self.count = 0
            self.table = t.translate(_HALVE)
            self.door = bytearray(len(d))
            self.resets += 1
        return m + 1
