"""Contract tests run against every eviction policy, plus the rules only ours promises.

Pure CPU and fast (a few seconds): small synthetic prefix-tree traces, no real trace, no
vLLM. ``PolicyContract`` is a mixin in the style of cachetools' tests: each concrete
``Test*`` class names a factory and inherits every contract check.
"""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from bench.policy_memory import adaptive_cost
from cache.policy import (
    DEFAULT_POLICY,
    POLICIES,
    EvictionPolicy,
    LRUPolicy,
    Offer,
    make_policy,
    policy_names,
)
from cache.policy.classic import ARCPolicy, S3FIFOPolicy
from cache.policy.experts import ARC, S3FIFO, PrefixLRU
from cache.policy.offline import BeladyPolicy, OfflinePolicy, RateOraclePolicy
from cache.policy.prefix_adaptive import PrefixAdaptivePolicy
from cache.policy.sketch import FrequencySketch
from cache.tools.replay import Request, replay


# ----------------------------------------------------------------------------- traces
def tree_trace(seed: int, n: int = 400, docs: int = 12, max_len: int = 8) -> List[Request]:
    """Shared system prompt + popular documents + a unique question, and one-off chains.

    Keys are ints, as the replay tool passes them; every request's blocks form a path of
    a prefix tree (equal key = equal prefix), like Mooncake ``hash_ids``.
    """
    rng = random.Random(seed)
    nxt = [1000]

    def fresh(k: int) -> List[int]:
        out = list(range(nxt[0], nxt[0] + k))
        nxt[0] += k
        return out

    system = fresh(2)
    doc_blocks = [fresh(rng.randint(2, max_len)) for _ in range(docs)]
    weights = [1.0 / (i + 1) for i in range(docs)]
    out: List[Request] = []
    for i in range(n):
        if rng.random() < 0.35:
            ids = fresh(rng.randint(1, max_len))  # one-off
        else:
            d = rng.choices(range(docs), weights)[0]
            ids = system + doc_blocks[d] + fresh(1)  # shared prefix + question
        out.append(Request(float(i), 512 * len(ids), tuple(ids)))
    return out


class CheckedPolicy(EvictionPolicy):
    """Wraps a policy and checks the store-side contract on every call."""

    def __init__(self, inner: EvictionPolicy, check_ancestors: bool = False) -> None:
        self.inner = inner
        self.check_ancestors = check_ancestors
        self.parent: Dict[object, Optional[object]] = {}
        self.children: Dict[object, int] = {}
        self.max_len = 0
        self.victims = 0

    def admit(self, key, parent, size):
        return self.inner.admit(key, parent, size)

    def insert(self, key, parent, size):
        assert key not in self.inner
        self.inner.insert(key, parent, size)
        assert key in self.inner
        self.parent[key] = parent
        if parent is not None and parent in self.inner:
            self.children[parent] = self.children.get(parent, 0) + 1
        self.max_len = max(self.max_len, len(self.inner))

    def touch(self, key):
        self.inner.touch(key)

    def remove(self, key):
        present = key in self.inner
        self.inner.remove(key)
        assert key not in self.inner
        if present:
            p = self.parent.pop(key, None)
            if p is not None and self.children.get(p):
                self.children[p] -= 1

    def victim(self):
        v = self.inner.victim()
        if len(self.inner):
            assert v is not None and v in self.inner
            assert self.inner.victim() == v, "victim() must not change state"
            if self.check_ancestors:
                assert not self.children.get(v), f"victim {v} still has a present child"
        self.victims += 1
        return v

    def hint_upcoming(self, keys):
        self.inner.hint_upcoming(keys)

    def __contains__(self, key):
        return key in self.inner

    def __len__(self):
        return len(self.inner)


# --------------------------------------------------------------------------- contract
class PolicyContract:
    """Every policy: bounded through the replay harness, victim present, no-op removes."""

    check_ancestors = False

    def make(self, requests: Sequence[Request] = ()) -> EvictionPolicy:
        raise NotImplementedError

    def test_empty(self):
        p = self.make()
        assert len(p) == 0
        assert p.victim() is None
        assert 1 not in p

    def test_insert_touch_remove(self):
        p = self.make([Request(0, 1024, (1, 2))])
        if isinstance(p, OfflinePolicy):
            p.begin_request((1, 2))
        p.insert(1, None, 1)
        p.insert(2, 1, 1)
        assert 1 in p and 2 in p and len(p) == 2
        p.touch(1)
        v = p.victim()
        assert v in p
        p.remove(v)
        assert v not in p and len(p) == 1

    def test_absent_are_noops(self):
        p = self.make()
        p.remove(42)
        p.touch(42)
        p.hint_upcoming([42, 43])
        assert len(p) == 0 and p.victim() is None
        p.insert(7, None, 1)
        p.remove(42)
        p.touch(42)
        assert len(p) == 1 and 7 in p

    def test_remove_all(self):
        p = self.make([Request(0, 2048, (1, 2, 3, 4))])
        if isinstance(p, OfflinePolicy):
            p.begin_request((1, 2, 3, 4))
        for k, parent in ((1, None), (2, 1), (3, 2), (4, 3)):
            p.insert(k, parent, 1)
        while len(p):
            v = p.victim()
            assert v in p
            p.remove(v)
        assert p.victim() is None

    @pytest.mark.parametrize("capacity", [1, 3, 17, 60])
    def test_bounded_replay(self, capacity):
        trace = tree_trace(seed=capacity)
        checked = CheckedPolicy(self.make(trace), self.check_ancestors)
        res = replay(trace, checked, capacity)
        assert checked.max_len <= capacity
        assert 0.0 <= res.token_hit_ratio <= 1.0
        assert checked.victims > 0

    def test_bounded_replay_with_hints(self):
        trace = tree_trace(seed=5)
        checked = CheckedPolicy(self.make(trace), self.check_ancestors)
        replay(trace, checked, 20, hint_window_ms=3.0)
        assert checked.max_len <= 20


class TestLRU(PolicyContract):
    def make(self, requests=()):
        return LRUPolicy()


class TestARC(PolicyContract):
    def make(self, requests=()):
        return ARCPolicy()


class TestS3FIFO(PolicyContract):
    def make(self, requests=()):
        return S3FIFOPolicy()


class TestBelady(PolicyContract):
    def make(self, requests=()):
        return BeladyPolicy([r.hash_ids for r in requests])


class TestRateOracle(PolicyContract):
    check_ancestors = True

    def make(self, requests=()):
        return RateOraclePolicy([r.hash_ids for r in requests])


class TestSpanOracle(PolicyContract):
    check_ancestors = True

    def make(self, requests=()):
        return RateOraclePolicy([r.hash_ids for r in requests], span=True)


def _oracle_run(requests, capacity, span):
    """Replay ``requests`` (key tuples) through a rate oracle; returns it and the hits."""
    trace = [Request(float(i), 512 * len(ids), ids) for i, ids in enumerate(requests)]
    oracle = RateOraclePolicy([r.hash_ids for r in trace], capacity=capacity, span=span)
    return oracle, replay(trace, oracle, capacity).hit_blocks


def test_rate_oracle_keeps_the_popular_chain_and_refuses_the_rest():
    # (1, 2) comes back four times; every other chain is used once. With room for two
    # blocks the oracle refuses the one-offs and serves every repeat of (1, 2).
    reqs = [(1, 2), (10, 11), (1, 2), (12, 13), (1, 2), (14, 15), (1, 2)]
    oracle, hits = _oracle_run(reqs, 2, span=False)
    assert hits == 2 * 3
    assert 1 in oracle and 2 in oracle and len(oracle) == 2


def test_rate_oracle_ranks_a_child_no_higher_than_its_parent():
    # Alone, 3 would rank above its parent 1 (2 reuses over 3 requests against 3 over
    # 6); capped at its parent's rate and deeper, it is the victim.
    reqs = [(1,), (2,), (2,), (1, 3), (1, 3), (1, 3)]
    oracle = RateOraclePolicy(reqs)
    oracle.begin_request(reqs[0])
    oracle.insert(1, None, 1)
    oracle.insert(3, 1, 1)
    assert oracle.victim() == 3


def test_span_oracle_evicts_a_block_after_its_last_use_first():
    # 5 is popular early and never used after request 3; 7 is used a little less often
    # per request but until the end. With room for one block the rate oracle keeps 5 and
    # refuses 7; the span oracle lets 5 go once it is dead and serves 7.
    reqs = [(5,), (5,), (5,), (5,), (7,), (8,), (9,), (10,), (11,), (7,), (12,), (13,), (7,)]
    span, span_hits = _oracle_run(reqs, 1, span=True)
    rate, rate_hits = _oracle_run(reqs, 1, span=False)
    assert rate_hits == 3 and 5 in rate
    assert span_hits == 3 + 2 and 7 in span


class TestPrefixAdaptive(PolicyContract):
    # The tier mirrors its leading expert; ARC and S3-FIFO may evict a parent first.

    def make(self, requests=()):
        return PrefixAdaptivePolicy()


def _sampled(slots: int) -> PrefixAdaptivePolicy:
    p = PrefixAdaptivePolicy()
    p.panel.SAMPLED_SLOTS = slots
    return p


class TestPrefixAdaptiveSampled(PolicyContract):
    # Experts sampled beyond 4 chunks of capacity: the tier runs a full-scale twin of its
    # leader, and drains the former one after a switch.

    def make(self, requests=()):
        return _sampled(4)


# ------------------------------------------------------------------ registry, default
def test_registry_and_default():
    assert DEFAULT_POLICY in POLICIES
    assert {"lru", "arc", "s3fifo", "prefix-adaptive"} <= set(policy_names())
    for name in policy_names():
        assert isinstance(make_policy(name), EvictionPolicy)
    with pytest.raises(ValueError):
        make_policy("nope")


# ---------------------------------------------------------------- ours: prefix rules
def serve(p: EvictionPolicy, chain: Sequence[int], cap: int) -> Tuple[int, List[Offer]]:
    """What a store of ``cap`` chunks does for one request: touch the leading run that is
    present, offer the rest; returns the hits and what became of each block offered."""
    hits = 0
    for k in chain:
        if k not in p:
            break
        p.touch(k)
        hits += 1
    outcomes, parent = [], chain[hits - 1] if hits else None
    for k in chain[hits:]:
        if k not in p:
            outcomes.append(p.offer(k, parent, 1, lambda: len(p) < cap))
        parent = k
    return hits, outcomes


def _fill(p: EvictionPolicy, chains: Sequence[Sequence[int]]) -> None:
    for chain in chains:
        parent = None
        for k in chain:
            p.insert(k, parent, 1)
            parent = k


def test_evicts_chain_tails_before_shared_roots():
    p = PrefixAdaptivePolicy()
    # root 1 is shared by two chains; 1 is touched first in each request
    _fill(p, [[1, 2, 3], [10, 11]])
    for k in (1, 2, 3):
        p.touch(k)
    p.insert(4, 1, 1)  # second child of the shared root
    order = []
    while len(p):
        v = p.victim()
        order.append(v)
        p.remove(v)
    assert order.index(1) > order.index(2) and order.index(1) > order.index(4)
    assert order.index(2) > order.index(3)
    assert order.index(10) > order.index(11)


@pytest.mark.parametrize("seed", range(4))
def test_never_evicts_an_ancestor_while_a_descendant_stays(seed):
    trace = tree_trace(seed, n=600, docs=20)
    checked = CheckedPolicy(PrefixLRU(), check_ancestors=True)
    replay(trace, checked, capacity_blocks=25, hint_window_ms=2.0 if seed % 2 else None)
    assert checked.victims > 100


def _admission_expert(cap: int) -> PrefixLRU:
    return PrefixLRU(history=FrequencySketch(64, 640), capacity=cap, count=True)


def test_admission_expert_refuses_the_rest_of_a_refused_chain_but_not_other_orphans():
    p = _admission_expert(10)
    _fill(p, [[k] for k in range(10)])
    assert not p.admit(1000, None, 1)  # full: a first sighting is refused
    assert not p.admit(1001, 1000, 1)  # its child could never be hit here
    assert not p.admit(1002, 1001, 1)  # nor its grandchild
    p.admit(5000, None, 1)
    assert p.admit(5000, 4999, 1)  # seen before, parent in another tier


def test_admission_expert_refuses_one_off_keys_once_full():
    """A full tier facing a flood of never-seen-again chains refuses them, and never
    refuses a key it has seen before."""
    cap = 50
    p = _admission_expert(cap)
    hot = [list(range(i * 5, i * 5 + 5)) for i in range(10)]  # 50 blocks
    _fill(p, hot)
    outcomes = []
    nxt = 10_000
    for rnd in range(40):
        for chain in hot[: 3 + rnd % 7]:  # hot reuse
            serve(p, chain, cap)
        for _ in range(4):  # one-off chains
            outcomes += serve(p, range(nxt, nxt + 3), cap)[1]
            nxt += 3
    assert outcomes.count(Offer.REFUSED) > 0.25 * len(outcomes)
    p.admit(777_777, None, 1)
    assert p.admit(777_777, None, 1)


def test_a_chunk_whose_parent_was_evicted_for_it_goes_first_and_ends_its_chain():
    p = PrefixLRU()
    _fill(p, [[1, 2]])
    assert p.admit(3, 2, 1)
    v = p.victim()
    assert v == 2  # the chain tail: the only leaf
    p.remove(v)
    p.insert(3, 2, 1)  # its parent is gone: worthless here
    assert p.victim() == 3
    p.remove(3)
    assert not p.admit(4, 3, 1)  # and so is the rest of the chain


@pytest.mark.parametrize("compact, classic", [(ARC, ARCPolicy), (S3FIFO, S3FIFOPolicy)])
@pytest.mark.parametrize("capacity", [5, 23, 80])
def test_compact_experts_decide_as_the_classics(compact, classic, capacity):
    trace = tree_trace(seed=capacity, n=500)
    assert replay(trace, compact(), capacity).hit_blocks == replay(trace, classic(), capacity).hit_blocks


def _starting_with(p: PrefixAdaptivePolicy, expert: str) -> PrefixAdaptivePolicy:
    p.panel.lead = p.panel.names.index(expert)
    return p


def test_a_last_tier_starts_with_admission_an_upper_tier_with_prefix_lru():
    assert PrefixAdaptivePolicy().leader == "prefix-lru+admission"
    assert PrefixAdaptivePolicy(last_tier=False).leader == "prefix-lru"


def test_tier_mirrors_its_leader_and_switches_on_evidence():
    """On scans mixed into a hot set, plain recency (made the starting leader here) loses
    to the frequency-aware experts: the tier switches, and ends about as good as the best
    classic (less what learning it cost on a short trace)."""
    from cache.tools.trace import capacity_for_fraction
    from cache.tools.workloads import generate

    trace = generate("scan", seed=1, scale=0.05)
    cap = capacity_for_fraction(trace, 0.05)
    p = _starting_with(PrefixAdaptivePolicy(), "prefix-lru")
    ours = replay(trace, p, cap).token_hit_ratio
    assert p.switches >= 1 and p.leader != "prefix-lru"
    best = max(replay(trace, make_policy(n), cap).token_hit_ratio for n in ("lru", "arc", "s3fifo"))
    assert ours >= best - 0.02


def test_sampled_experts_stay_small_and_the_tier_still_follows_the_evidence():
    """Beyond ``SAMPLED_SLOTS`` the experts simulate a spatial sample at a scaled capacity
    (memory bounded whatever the tier's size); the tier, a full-scale twin of the
    leader, still switches on their evidence and ends near the best classic."""
    from cache.tools.trace import capacity_for_fraction
    from cache.tools.workloads import generate

    trace = generate("scan", seed=1, scale=0.05)
    cap = capacity_for_fraction(trace, 0.2)
    p = _starting_with(_sampled(128), "prefix-lru")
    ours = replay(trace, p, cap).token_hit_ratio
    panel = p.panel
    assert panel.rate <= 1 / 4 and panel.scap <= 128
    assert all(len(e) <= panel.scap for e in panel.experts)
    for e in panel.experts:  # thinned: only sampled keys (stored + 1)
        assert all(k <= panel.limit for k in e.slot_keys()), e.name
    assert p.switches >= 1 and p.leader != "prefix-lru" and len(p) <= cap
    best = max(replay(trace, make_policy(n), cap).token_hit_ratio for n in ("lru", "arc", "s3fifo"))
    print(f"sampled at 1/{1 / panel.rate:.0f}: {ours:.4f}, best classic {best:.4f}")
    assert ours >= best - 0.03


def test_hint_protects_present_keys_until_touched():
    p = PrefixAdaptivePolicy()
    cap = 20
    _fill(p, [[k] for k in range(cap)])
    assert p.victim() is not None
    protected = [0, 1, 2]  # the oldest: first in line otherwise
    p.hint_upcoming(protected)
    nxt = 100
    for _ in range(cap // 2):
        p.admit(nxt, None, 1)  # seen before: passes the admission gate
        if p.admit(nxt, None, 1):
            while len(p) >= cap:
                v = p.victim()
                assert v not in protected
                p.remove(v)
            p.insert(nxt, None, 1)
        nxt += 1
    assert all(k in p for k in protected)
    p.touch(0)  # the queued request came: no longer pinned
    p.hint_upcoming([])  # queue is empty now: nothing pinned
    for _ in range(3 * cap):
        p.admit(nxt, None, 1)
        if p.admit(nxt, None, 1):
            while len(p) >= cap:
                p.remove(p.victim())
            p.insert(nxt, None, 1)
        nxt += 1
    assert not any(k in p for k in protected)


def test_everything_protected_still_yields_a_victim():
    p = PrefixAdaptivePolicy()
    _fill(p, [[1, 2, 3], [4, 5]])
    p.hint_upcoming([1, 2, 3, 4, 5])
    v = p.victim()
    assert v in (3, 5)  # a leaf, never an ancestor
    p.remove(v)
    assert len(p) == 4


def test_upper_tier_takes_everything_and_keeps_chains_across_tiers():
    """``last_tier=False`` (a store's DRAM above a disk tier): a chain longer than the
    tier goes in whole (its older part is demoted), nothing is refused."""
    p = make_policy(DEFAULT_POLICY, last_tier=False)
    assert isinstance(p, PrefixAdaptivePolicy)
    assert isinstance(make_policy("lru", last_tier=False), LRUPolicy)
    cap, demoted, parent = 4, [], None
    for k in range(8):
        assert p.admit(k, parent, 1)
        while len(p) >= cap:
            v = p.victim()
            demoted.append(v)
            p.remove(v)
        p.insert(k, parent, 1)
        parent = k
    assert len(demoted) == 4 and len(p) == cap and 7 in p  # every chunk taken in
    for k in range(100, 300):  # a flood of first sightings: all admitted
        assert p.admit(k, None, 1)
        while len(p) >= cap:
            p.remove(p.victim())
        p.insert(k, None, 1)


def test_demoted_tail_whose_parent_is_in_a_faster_tier():
    """A lower tier receives chain tails first; they are stored as roots here."""
    p = PrefixAdaptivePolicy()
    p.insert(3, 2, 1)  # 2 lives in the tier above
    p.insert(2, 1, 1)
    assert len(p) == 2
    assert p.victim() in (2, 3)


def test_external_removal_of_an_inner_chunk():
    p = PrefixAdaptivePolicy()
    _fill(p, [[1, 2, 3]])
    p.remove(2)  # vanished behind our back (shared tier)
    assert len(p) == 2
    seen = set()
    while len(p):
        v = p.victim()
        assert v not in seen
        seen.add(v)
        p.remove(v)
    assert seen == {1, 3}
    _fill(p, [[4, 5]])  # slots are reused cleanly
    assert p.victim() == 5


# ---------------------------------------------------------------------- memory bound
def test_memory_fits_ten_million_chunks_in_under_1_6_gib():
    """Beyond ``ExpertPanel.SAMPLED_SLOTS`` the experts are sampled: a tracked chunk costs
    the tier's index, one full-scale policy and the sketch; the experts a fixed amount."""
    per_chunk, fixed = adaptive_cost()
    total = per_chunk * 10_000_000 + fixed
    print(
        f"prefix-adaptive: {per_chunk:.0f} bytes per tracked chunk + {fixed / 2**20:.0f} MiB "
        f"of experts -> {total / 2**30:.2f} GiB for 10 million"
    )
    assert total < 1.6 * 2**30


def test_a_switch_undone_within_its_window_doubles_the_evidence_the_next_needs():
    """Two experts trading a narrow lead batch by batch: the first switch back within its
    evidence window doubles the lead a challenger needs; a window with no switch halves it back."""
    from cache.policy.panel import ExpertPanel

    panel = ExpertPanel(last_tier=False, history=FrequencySketch(64, 640))
    panel.resize(1000, full=True)

    def batch(hits: Dict[int, int]) -> bool:
        panel.batch = [hits.get(i, 0) for i in range(len(panel.experts))]
        panel.nacc = panel.BATCH
        return panel.weigh()

    assert panel.lead == 0
    assert batch({1: 8})  # arc leads by 8 hits: switch
    assert panel.lead == 1 and panel.backoff == 1
    assert batch({0: 30})  # prefix LRU wins it back at once
    assert panel.lead == 0 and panel.backoff == 2  # undone within its window
    while panel.backoff > 1:  # a stable stretch halves it back
        assert not batch({})
    assert panel.lead == 0 and panel.switches == 2
