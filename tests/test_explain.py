"""Explanations without an engine: the scheduler side with stand-in requests and a real
writer store whose events travel as the workers' would (``cache.explain``). The real
engine drives every cause in ``tests/test_explain_engine.py``."""

from types import SimpleNamespace

import numpy as np
import pytest

from cache.assembly import build_tiers
from cache.codec import HEADER_SIZE
from cache.config import build_cache_config
from cache.explain import CAUSES, Explainer, compact
from cache.keys import Namespace
from cache.policy import LRUPolicy
from cache.store import TieredStore
from cache.vllm.scheduler import SchedulerSide
from tests.test_scheduler_side import BLOCK, CHUNK, Blocks, output, request


@pytest.fixture
def setup(tmp_path):
    return make_setup(tmp_path)


def make_setup(tmp_path):
    cfg = build_cache_config(
        {
            "KVCACHE_DRAM_PATH": str(tmp_path / "shm"),
            "KVCACHE_DRAM_SIZE": "16MiB",
            "KVCACHE_DISK_PATH": str(tmp_path / "disk"),
            "KVCACHE_DISK_SIZE": "16MiB",
            "KVCACHE_SIGNING_KEY": "k",
        }
    )
    ns = Namespace("m", "d", "bfloat16", "x", chunk_tokens=CHUNK)
    manager = SimpleNamespace(get_block_ids=lambda req_id: (list(range(100, 200)),))
    side = SchedulerSide(cfg, [ns], BLOCK, lambda: manager)
    events: list = []
    writer = TieredStore(
        build_tiers(cfg, ns.id),
        ns.digest,
        [LRUPolicy(), LRUPolicy()],
        signing_key=b"k",
        on_event=lambda *e: events.append(e),
    )

    def settle():
        writer.flush(10)
        side.explain.worker_events(list(events))
        events.clear()

    return side, writer, settle


def run(side, writer, settle, req, computed=0):
    """One request through lookup, (load,) compute, save and finish; its explanation."""
    n, _ = side.get_num_new_matched_tokens(req, computed)
    if n:
        side.update_state_after_alloc(req, Blocks(list(range(12))), n)
    meta = side.build_connector_meta(
        output(new=[(req.request_id, computed + (n or 0))], scheduled={req.request_id: 2000})
    )
    for c in meta.saves:
        writer.put(c.key, c.parent, "uint8", (4,), np.zeros(4, np.uint8))
    settle()
    side.saves_settled([c.key for c in meta.saves])
    why = side.explain_finished(req)
    side.request_finished(req)
    return [(r["tokens"][0], r["tokens"][1], r.get("from") or r["computed"], r.get("tier")) for r in why]


def test_hit_miss_and_the_last_token(setup):
    side, writer, settle = setup
    assert run(side, writer, settle, request("a", 700)) == [(0, 699, "never_stored", None)]
    assert run(side, writer, settle, request("b", 700)) == [(0, 699, "dram", None)]
    # vLLM's own prefix cache held the first 256: only the rest is ours
    assert run(side, writer, settle, request("c", 700), computed=256) == [
        (0, 256, "vllm", None),
        (256, 699, "dram", None),
    ]
    assert side.explain.take_counts() == {"miss:never_stored:none": 699}
    assert side.explain.take_counts() == {}


def evict(writer, i, key):
    """Evict ``key`` from local tier ``i`` as its policy would (demoted, or dropped from the last)."""
    writer.writer.evict(i, key)


def test_evicted_not_admitted_and_after_miss(setup):
    side, writer, settle = setup
    req = request("a", 1500)
    run(side, writer, settle, req)
    keys = list(side.explain.fates.last)
    # the second chunk leaves the tiers through the policies (demoted, then evicted); the rest stays
    evict(writer, 0, keys[1])
    evict(writer, 1, keys[1])
    settle()
    assert run(side, writer, settle, request("b", 1500)) == [
        (0, 256, "dram", None),
        (256, 512, "evicted", "disk"),
        (512, 1499, "after_miss", None),
    ]
    # a request that may not save: the next one is told why nothing was there
    quiet = request("q", 600, seed=9)
    quiet.kv_transfer_params = {"kvcache_save": False}
    run(side, writer, settle, quiet)
    assert run(side, writer, settle, request("r", 600, seed=9)) == [(0, 599, "not_admitted", None)]


def test_evicted_for_good_names_the_tier_it_left(setup):
    side, writer, settle = setup
    run(side, writer, settle, request("a", 600))
    key = side.explain.fates.last.__iter__().__next__()
    evict(writer, 0, key)  # demoted to disk ...
    evict(writer, 1, key)  # ... and evicted from there
    settle()
    assert run(side, writer, settle, request("b", 600))[0] == (0, 256, "evicted", "disk")


def salted(req_id, n, salt, seed=0):
    req = request(req_id, n, seed)
    req.cache_salt = salt
    return req


def test_another_salt_holds_the_tokens(setup):
    """A prefix held under another salt is never_stored to the request; operators see it
    counted as other_namespace."""
    side, writer, settle = setup
    run(side, writer, settle, salted("a", 600, "tenant-a"))
    side.explain.take_counts()
    assert run(side, writer, settle, request("b", 600)) == [(0, 599, "never_stored", None)]
    assert side.explain.take_counts() == {"miss:other_namespace:none": 599}
    assert run(side, writer, settle, salted("c", 600, "tenant-a")) == [(0, 599, "dram", None)]


@pytest.mark.parametrize("guesser", ["tenant-b", None])
def test_a_guess_of_another_tenants_prompt_learns_nothing(tmp_path, guesser):
    """The guess oracle: a right and a wrong guess of tenant A's prompt, from another salt
    or from none, get the same explanation (a guess right in its first chunk only too).
    Each guess is the guesser's first request, on a cache where A's prompt is stored."""
    secret = salted("a", 700, "tenant-a", seed=1).prompt_token_ids
    other = request("x", 700, seed=2).prompt_token_ids
    seen = []
    for i, guess in enumerate((secret, other, secret[:256] + other[256:])):
        side, writer, settle = make_setup(tmp_path / str(i))
        run(side, writer, settle, salted("a", 700, "tenant-a", seed=1))
        req = request("g", 700)
        req.prompt_token_ids = req.all_token_ids = list(guess)
        req.cache_salt = guesser
        side.explain.take_counts()
        seen.append((run(side, writer, settle, req), side.explain.take_counts()))
    assert seen[0][0] == seen[1][0] == seen[2][0] == [(0, 699, "never_stored", None)]
    # operators' aggregate: what another namespace held, and what nobody did
    assert [counts for _, counts in seen] == [
        {"miss:other_namespace:none": 699},
        {"miss:never_stored:none": 699},
        {"miss:other_namespace:none": 256, "miss:never_stored:none": 443},
    ]


def test_damaged_and_unsigned_entries_found_by_a_load(setup, tmp_path):
    side, writer, settle = setup
    run(side, writer, settle, request("a", 600))
    first, second = list(side.explain.fates.last)[:2]
    path = writer.tiers[0].path(second)
    raw = bytearray(open(path, "rb").read())
    raw[HEADER_SIZE] ^= 0xFF
    open(path, "wb").write(raw)
    req = request("b", 600)
    n, _ = side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, Blocks(list(range(12))), n)
    (load,) = side.build_connector_meta(output()).loads
    assert writer.get(first) is not None and writer.get(second) is None  # the worker's reads
    settle()
    side.loads_failed(set(load.chunks[1].block_ids))
    why = side.explain_finished(req)
    assert [(r.get("from") or r["computed"], r.get("tier")) for r in why] == [
        ("dram", None),
        ("damaged", "dram"),
        ("after_miss", None),
    ]
    assert side.request_finished(req) == {"dram": 256}  # only the chunk before the failure loaded
    # the damaged entry was dropped: the next request is told why it is missing
    assert run(side, writer, settle, request("c", 600))[1] == (256, 512, "damaged", "dram")
    # an entry signed with another key
    foreign = request("d", 600, seed=5)
    run(side, writer, settle, foreign)
    key = list(side.explain.fates.last)[-1]
    from cache.codec import encode_header

    payload = np.zeros(4, np.uint8)
    path = writer.tiers[0].path(key)
    with open(path, "wb") as f:
        f.write(encode_header(writer.namespace, key, "uint8", (4,), payload, b"other") + payload.tobytes())
    assert writer.get(key) is None
    settle()
    assert run(side, writer, settle, request("e", 600, seed=5))[-1][2:] == ("unsigned", "dram")


def damage(path):
    raw = bytearray(open(path, "rb").read())
    raw[HEADER_SIZE] ^= 0xFF
    open(path, "wb").write(raw)


def test_a_hit_is_named_after_the_tier_that_served_it(setup):
    """The lookup finds DRAM; its copy is damaged, so the worker's read falls back to the
    disk copy, which serves: the explanation and the loaded tokens say disk. A later
    request served from DRAM as planned is not told about that earlier fallback."""
    side, writer, settle = setup
    run(side, writer, settle, request("a", 600))
    keys = list(side.explain.fates.last)[:2]
    writer.persist(keys)  # on disk too
    settle()
    damage(writer.tiers[0].path(keys[0]))
    for name, expect in (("b", "disk"), ("c", "dram")):  # b's read promotes the disk copy back up
        req = request(name, 600)
        n, _ = side.get_num_new_matched_tokens(req, 0)
        side.update_state_after_alloc(req, Blocks(list(range(12))), n)
        (load,) = side.build_connector_meta(output()).loads
        assert [c.tier for c in load.chunks] == ["dram", "dram", "dram"]
        for chunk in load.chunks:  # the worker's loads (cache.vllm.worker._loaded)
            entry = writer.get(chunk.key)
            writer.note_loaded(entry.tier, chunk.tokens, chunk.key, chunk.tier)
        settle()
        why = [(r["tokens"], r.get("from")) for r in side.explain_finished(req)]
        loaded = side.request_finished(req)
        if expect == "disk":
            assert why == [([0, 256], "disk"), ([256, 599], "dram")] and loaded == {"disk": 256, "dram": 343}
        else:
            assert why == [([0, 599], "dram")] and loaded == {"dram": 599}


def test_a_request_that_skips_the_prefix_cache_loads_nothing(setup):
    """vLLM drops the hit of a request with prompt_logprobs (skip_reading_prefix_cache):
    nothing is planned, and the explanation says recompute."""
    side, writer, settle = setup
    run(side, writer, settle, request("a", 600))
    req = request("b", 600)
    req.skip_reading_prefix_cache = True
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert run(side, writer, settle, req) == [(0, 599, "recompute", None)]


def test_a_request_failed_whole_loaded_nothing(setup):
    """Hybrid models' loads fail per request (vLLM computes it all again)."""
    side, writer, settle = setup
    run(side, writer, settle, request("a", 600))
    req = request("b", 600)
    n, _ = side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, Blocks(list(range(12))), n)
    side.build_connector_meta(output())
    side.requests_failed({req.request_id})
    why = side.explain_finished(req)
    assert [(r.get("from") or r["computed"]) for r in why][-1] == "after_miss"
    assert "dram" not in [r.get("from") for r in why] and side.request_finished(req) == {}


def test_writing_recompute_and_shared_down(setup):
    side, writer, settle = setup
    req = request("a", 600)
    side.get_num_new_matched_tokens(req, 0)
    side.build_connector_meta(output(new=[("a", 0)], scheduled={"a": 600}))  # saves sent, not settled
    side.request_finished(req)
    saving = side.saves.in_flight
    look = side.explain.looked_up([], 0, [(k, 0, 1) for k in saving], [], saving)
    assert {c for c, _t in look.misses} == {"writing"}
    no_load = request("b", 600)
    no_load.kv_transfer_params = {"kvcache_load": False}
    assert run(side, writer, settle, no_load) == [(0, 599, "recompute", None)]
    down = Explainer(b"c" * 16, CHUNK, "dram", shared_up=lambda: False)
    look = down.looked_up(list(range(600)), 0, [("k1", 0, 256), ("k2", 256, 512)], [], {})
    assert look.misses == [("shared_unreachable", "shared")] * 2
    # a publish in flight, a read past its deadline, a cost model's choice
    ex = Explainer(b"c" * 16, CHUNK, "dram")
    ex.worker_events([("k1", "publishing", "shared"), ("k2", "load_timeout", "shared"), ("k2", "missing", "none")])
    look = ex.looked_up(list(range(800)), 0, [("k0", 0, 256), ("k1", 256, 512), ("k2", 512, 768)], ["dram"], {})
    assert look.misses == [("writing", "shared"), ("load_timeout", "shared")]
    ex.chose_recompute(look, 0)
    assert [r["computed"] for r in ex.finished(look)] == ["recompute", "writing", "load_timeout"]


def test_a_failed_load_says_what_its_planned_tier_found():
    """DRAM's copy was unsigned; the read fell back to a shared tier that was down; the
    recompute stored the chunk again before the request finished. The request was
    computed because of the unsigned copy, and says so."""
    ex = Explainer(b"c" * 16, CHUNK, "dram")
    chunks = [("k0", 0, 256), ("k1", 256, 512), ("k2", 512, 599)]
    ex.worker_events([("k0", "stored", "dram"), ("k1", "stored", "dram")])
    look = ex.looked_up(list(range(600)), 0, chunks, ["dram", "dram"], {})
    ex.worker_events([("k0", "unsigned", "dram"), ("k0", "shared_unreachable", "shared")])
    ex.load_failed(look, "k0")
    ex.worker_events([("k0", "stored", "dram"), ("k0", "shared_unreachable", "shared")])
    assert [(r["computed"], r.get("tier")) for r in ex.finished(look)] == [
        ("unsigned", "dram"),
        ("after_miss", None),
        ("never_stored", None),
    ]
    # a load planned from the shared tier is explained by what that tier did
    look = ex.looked_up(list(range(600)), 0, chunks[1:], ["shared"], {})
    ex.worker_events([("k1", "load_timeout", "shared"), ("k1", "missing", "none")])
    ex.load_failed(look, "k1")
    assert ex.finished(look)[0] == {"tokens": [256, 512], "computed": "load_timeout", "tier": "shared"}


def test_a_rejected_copy_explains_a_miss_while_the_shared_tier_is_down():
    down = Explainer(b"c" * 16, CHUNK, "dram", shared_up=lambda: False)
    down.worker_events(
        [
            ("k0", "damaged", "dram"),
            ("k0", "shared_unreachable", "shared"),
            ("k1", "stored", "dram"),
            ("k1", "evicted", "dram"),
            ("k2", "unsigned", "dram"),
            ("k2", "stored", "disk"),
            ("k2", "evicted", "disk"),
        ]
    )
    look = down.looked_up(list(range(800)), 0, [("k0", 0, 256), ("k1", 256, 512), ("k2", 512, 768)], [], {})
    # k1 and k2 were lost to eviction: the shared tier, were it up, might have served them
    assert look.misses == [("damaged", "dram"), ("shared_unreachable", "shared"), ("shared_unreachable", "shared")]


def test_records_are_bounded():
    ex = Explainer(b"c" * 16, CHUNK, "dram", limit=100)
    ex.worker_events([(f"k{i}", "evicted", "dram") for i in range(1000)])
    assert len(ex.fates.last) == 100 and ex.fates.get("k999") == ("evicted", "dram")


def test_compact_header_value():
    why = [{"tokens": [0, 1408], "from": "vllm"}, {"tokens": [1408, 1499], "computed": "evicted", "tier": "disk"}]
    assert compact(why) == "vllm:0-1408,evicted/disk:1408-1499"
    assert compact([]) == "none"
    long = [{"tokens": [i, i + 1], "computed": "never_stored"} for i in range(500)]
    text = compact(long, 1024)
    assert len(text) <= 1024 and text.endswith(f",+{500 - text.count(',')}") and text.isascii()
    assert set(CAUSES) >= {
        "never_stored",
        "evicted",
        "not_admitted",
        "other_namespace",
        "damaged",
        "unsigned",
        "writing",
        "load_timeout",
        "shared_unreachable",
        "recompute",
    }
