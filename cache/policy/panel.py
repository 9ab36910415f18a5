"""The experts ``prefix-adaptive`` chooses between, simulated in miniature, and the
evidence that names the leader.

Runs inside ``prefix-adaptive`` (wherever a tier runs), under the store's lock: every call
is O(1) amortized, with no I/O and no sleeping.

Each expert (``cache.policy.experts``) is a complete policy with its own content, fed the
tier's access stream; its hits are counted as a request would see them (a chunk counts
only when its whole prefix is present in that expert). The leader is the expert that has
served the most prefix hits lately: a challenger takes over when its lead (hits summed in
batches of ``BATCH`` simulated accesses, decayed over ``HORIZON`` capacities and at least
64 batches) exceeds ``Z`` standard errors of their batch-by-batch difference, plus one
hit. Evidence is never reset, so after a switch the old leader has to win the lead back:
near-ties do not make the tier flap. Where two experts are tied within noise that is not
enough: a switch undone within the evidence window it was decided on (the old leader won
the lead back before that evidence decayed) doubles the lead the next switch needs, and
each window without a switch halves it back (an exponential back-off, as TCP's, with no
fitted constant). Measured at seeds 1 and 2 of the robustness grid, this took the rag 1 %
cell of seed 1 from -0.0071 (19 switches) to -0.0047 (15), and seed 1's worst margin
from -0.0074 to -0.0066 (shift 10 %, where the switches are not reverts).

How much evidence a switch needs follows from what a switch costs. While the experts are
exact, the tier keeps every chunk the old and the new leader share and converges to the
new one within a turnover, so a switch is cheap and following a worse leader for longer
is what costs: ``Z_EXACT`` = half a standard error. Measured on the six weakest cells of
the robustness grid (``bench/bench_policy.py``, scale 0.6; rag, shift, chat, Mooncake),
the worst margin over the best classic went -0.0041 / -0.0042 / -0.0053 / -0.0107 /
-0.0149 at 0 / 0.5 / 1 / 2 / 3 standard errors: waiting for more evidence lost more than
the switches it saved (zero and a half were within noise of each other). With this rule
and the start below, the whole grid's worst margin is -0.0033 (rag at 20 %; it was -0.0053
with one standard error from prefix LRU). Once
sampled, a switch starts a cold full-scale policy (up to 0.02 lost, below), so the
test stays at ``Z`` = one standard error there.

A last tier starts with prefix LRU + TinyLFU admission (Einziger et al., "TinyLFU",
ACM TOS 2017): a first sighting is refused only while the tier is full, so a wrong
refusal costs one recompute, while a wrong admission of a one-off evicts a chunk that may
be reused. Before the tier is first full every expert takes every chunk, so all hold the
same content and there is no evidence; the start only decides whom the tier follows
until the first evidence (on Mooncake at 20 %, starting with plain prefix LRU lost
0.0021 to the admission expert alone before the one switch). Upper tiers start with
prefix LRU.

Miniature simulation (SHARDS: Waldspurger et al., "Cache Modeling and Optimization using
Miniature Simulations", USENIX ATC'17). The experts simulate only the chunks whose
fingerprint falls below a threshold (``limit``: a share ``rate`` = 2**-``shift`` of the
62-bit fingerprint space, a uniform spatial sample), at the tier's capacity scaled by the
same rate. While the capacity is at most ``SAMPLED_SLOTS`` the rate is 1: every chunk is
simulated, exactly. Beyond it the rate halves each time the capacity doubles, so each
expert tracks at most about ``SAMPLED_SLOTS`` chunks (plus its ghosts) and costs bounded
memory and time whatever the tier's size; the keys a halving leaves out are shed a few
slots per access (``THIN``), never in one pass. The evidence logic runs on the sampled
stream unchanged (batches of sampled accesses, decay over sampled capacities), so the
sampling noise is part of the standard error it tests against.

Prefix chains are sampled per chunk, not per chain root. A shared system prompt is the
root of nearly every chain (every request of the chat, RAG and shift workloads hangs off
one root), so sampling by root would keep all of them or none; per-chunk sampling keeps a
uniform share of every tree. Each expert sees the *contracted* chain: a sampled chunk's
parent is its nearest sampled ancestor in the request (tracked across the request's
consecutive accesses), or none when every ancestor is unsampled or the chain starts in
another tier. Prefix order (a parent outlives its children), refused chains and the
prefix-hit rule (a chunk hits only when its sampled ancestors do) all act on that
contracted chain, so a sampled chunk whose parent is not sampled behaves as the child of
the nearest one that is. The price: an expert cannot see that an unsampled ancestor is
missing, so as the rate drops its count drifts from prefix hits towards chunk hits (at
rate 1/8 on chat at 2 % capacity, about three times the exact counts), most for ARC and
S3-FIFO, whose evictions leave holes in chains; the experts are compared under the same
drift, and the measured effect on the tier is below.

``SAMPLED_SLOTS`` comes from the measured error (``bench/bench_policy_sampling.py``,
``bench/results/policy_sampling.md``): with sampled experts the tier's token hit ratio
matches exact simulation where the leader settles while the tier fills (chat), and loses
up to about 0.02 where it changes later (RAG, scans): the new leader's full-scale policy
starts cold. That loss did not shrink with the sample (1,024 and 4,096 sampled slots lose
the same), so the threshold is as high as memory comfortably allows: every tier up to
131,072 chunks (4 TiB of Llama-3-8B KV in 256-token chunks) is simulated exactly, and
beyond it the experts cost a fixed 30-40 MiB.
"""

from __future__ import annotations

import copy
from typing import Callable, List, Optional

from .base import EvictionPolicy
from .experts import ARC, S3FIFO, Compact, PrefixLRU
from .sketch import FrequencySketch

KEY_SPACE = 1 << 62  # fingerprints are 62-bit (``cache.policy.slots``)
_UNBOUNDED = 1 << 62


class ExpertPanel:
    """The experts, their (sampled) simulation and the leader choice (module docstring)."""

    Z = 1.0  # standard errors a challenger must lead by, experts sampled ...
    Z_EXACT = 0.5  # ... and exact (module docstring: what a switch costs)
    BATCH = 64  # sampled accesses per evidence sample (a chain's hits come together)
    HORIZON = 16  # evidence decays over this many capacities of accesses ...
    MIN_WINDOW = 64 * BATCH  # ... and never over fewer than 64 batches
    SAMPLED_SLOTS = 1 << 17  # simulated exactly up to this capacity; sampled beyond
    THIN = 32  # slots per expert checked per access after the rate drops

    def __init__(self, *, last_tier: bool, history: FrequencySketch) -> None:
        self.last_tier = last_tier
        self.experts: List[Compact] = [PrefixLRU(last_tier=last_tier), ARC(), S3FIFO()]
        self.names = ["prefix-lru", "arc", "s3fifo"]
        self.admission: Optional[int] = None  # the expert with an admission filter
        if last_tier:
            self.admission = len(self.experts)
            self.experts.append(PrefixLRU(history=history))
            self.names.append("prefix-lru+admission")
        k = len(self.experts)
        self.lead = self.admission if self.admission is not None else 0
        self.switches = 0
        self.backoff = 1  # evidence multiplier after reverted switches
        self._prev = -1  # the leader before the last switch ...
        self._since = 0  # ... and sampled accesses since it
        self._calm = 0  # sampled accesses since the last halving
        self.shift = 0  # rate = 2 ** -shift
        self.limit = KEY_SPACE  # fingerprints below it are simulated
        self.cap = 0  # the tier's capacity ...
        self.scap = 0  # ... scaled by the rate
        self.full = False
        self.last = 0  # fingerprint of the last access
        self._lanc = 0  # its nearest sampled ancestor-or-self
        self._slast = 0  # the last sampled access
        self._hit = [False] * k  # each expert's verdict on it
        self.batch = [0] * k  # this batch's hits, per expert
        self._score = [0.0] * k  # decayed sums of batch hits ...
        self._sq = [[0.0] * k for _ in range(k)]  # ... and of squared pairwise differences
        self.nacc = 0
        self._bound = _UNBOUNDED  # entries an expert may hold
        self._thin = [0] * k  # per expert: next slot to thin, 0: done
        self._thinning = False
        self._room = [self._room_for(e) for e in self.experts]

    def _room_for(self, e: EvictionPolicy) -> Callable[[], bool]:
        return lambda: len(e) < self._bound

    @property
    def rate(self) -> float:
        """The share of chunks the experts simulate."""
        return 1.0 / (1 << self.shift)

    # ------------------------------------------------------------------ capacity
    def resize(self, cap: int, full: bool) -> None:
        """The tier holds up to ``cap`` chunks (``full``: it has evicted): pick the rate
        and scale the experts' capacity to it."""
        self.cap, self.full = cap, full
        shift = self.shift
        while cap > self.SAMPLED_SLOTS << shift:
            shift += 1
        if shift != self.shift:
            factor = 1.0 / (1 << (shift - self.shift))
            self.shift, self.limit = shift, KEY_SPACE >> shift
            for i, e in enumerate(self.experts):
                e.rescale(factor)
                self._thin[i] = 1
            self._thinning = True
        self.scap = cap if not self.shift else max(1, round(cap / (1 << self.shift)))
        self._bound = self.scap if full and not self._thinning else _UNBOUNDED

    def detach_leader(self, history: FrequencySketch) -> Compact:
        """The leader itself, which goes on at full scale as the tier's own policy; the
        panel keeps a copy of it, thinned to the sample like every other expert."""
        lead = self.experts[self.lead]
        clone = copy.deepcopy(lead, {id(history): history})
        self.experts[self.lead] = clone
        self._room[self.lead] = self._room_for(clone)
        return lead

    def make(self, i: int) -> Compact:
        """A fresh, empty policy of expert ``i``'s kind, for a full-scale tier."""
        e = self.experts[i]
        if i == self.admission:
            return PrefixLRU(history=e.history)
        return type(e)(last_tier=self.last_tier)

    # -------------------------------------------------------------------- access
    def access(self, k: int, pk: int, evict: Optional[Callable[[int], None]] = None) -> None:
        """Every expert serves one access of fingerprint ``k`` (parent ``pk``, 0: none)
        if it is sampled; ``evict`` hears what the leader drops."""
        if not pk:
            anc = 0
        elif pk == self.last:
            anc = self._lanc
        else:
            anc = pk if pk < self.limit else 0
        self.last = k
        if k >= self.limit:
            self._lanc = anc
            if self._thinning:
                self._thin_step()
            return
        self._lanc = k
        last, hit, experts, room = self._slast, self._hit, self.experts, self._room
        parent = anc or None
        lead = self.lead if evict is not None else -1
        for i, e in enumerate(experts):
            if k in e:
                h = not anc or (hit[i] if anc == last else anc in e)
                if h:
                    e.touch(k)  # a hit there (else recomputed: no touch)
            else:
                h = False
                e.offer(k, parent, 1, room[i], evict=evict if i == lead else None)
            hit[i] = h
        self._slast = k
        batch = self.batch
        for i in range(len(experts)):
            batch[i] += hit[i]
        self.nacc += 1
        if self._thinning:
            self._thin_step()

    def _thin_step(self) -> None:
        """Shed a few keys the last rate drop left out of the sample, in every expert."""
        thin, limit = self._thin, self.limit
        for i, e in enumerate(self.experts):
            if thin[i]:
                thin[i] = e.thin(limit, thin[i], self.THIN)
        if not any(thin):
            self._thinning = False
            if self.full:
                self._bound = self.scap  # thinned: hold the scaled capacity

    def weigh(self) -> bool:
        """One batch of evidence; switch to the challenger that leads the leader by more
        than ``Z`` standard errors of their difference (True when it did). Evidence is
        never reset: after a switch the old leader must win the lead back (hysteresis
        against flapping), and a switch undone within its evidence window doubles the
        lead the next one needs (``backoff``), halved back by each window without a
        switch (module docstring)."""
        self._since += self.nacc
        self._calm += self.nacc
        self.nacc = 0
        window = max(self.MIN_WINDOW, self.HORIZON * max(self.scap, 64))
        if self._calm >= window and self._since >= window:
            self.backoff = max(1, self.backoff // 2)  # a calm window: halve back
            self._calm = 0
        decay = (1.0 - 1.0 / window) ** self.BATCH
        b, score, sq = self.batch, self._score, self._sq
        k = len(b)
        for i in range(k):
            score[i] = score[i] * decay + b[i]
            row = sq[i]
            for j in range(i + 1, k):
                d = b[i] - b[j]
                row[j] = sq[j][i] = row[j] * decay + d * d
        self.batch = [0] * k
        lead = self.lead
        z = self.Z if self.shift else self.Z_EXACT
        best, best_by = -1, 0.0
        for i in range(k):
            by = score[i] - score[lead]
            if i != lead and by > self.backoff * (z * sq[i][lead] ** 0.5 + 1.0) and by > best_by:
                best, best_by = i, by
        if best < 0:
            return False
        if best == self._prev and self._since < window:
            self.backoff *= 2  # the last switch undone: double
        self._prev, self._since, self._calm = lead, 0, 0
        self.lead = best
        self.switches += 1
        return True
