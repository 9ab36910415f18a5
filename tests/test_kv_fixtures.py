"""The GPU conformance suite's fixtures are vLLM's own views: regenerated here with the
installed vLLM's functions (``bench.kv_fixtures``, on the meta device), they must equal the
committed ``bench/fixtures/kv_views.json``. The day vLLM changes how it cuts its KV cache,
this fails, and ``python -m bench.kv_fixtures --write`` records the new views (then the
suite, on CPU here and on a GPU machine, says whether the connector still copies them)."""

from bench import kv_fixtures
from cache.vllm.kv_copy import KVLayout


def test_the_committed_views_are_what_the_installed_vllm_builds():
    fresh, committed = kv_fixtures.generate(), kv_fixtures.load()
    assert fresh["vllm"] == committed["vllm"]
    changed = sorted(
        k for k in set(fresh["cases"]) | set(committed["cases"]) if fresh["cases"].get(k) != committed["cases"].get(k)
    )
    assert changed == [], f"vLLM's KV cache views changed: {changed}; run python -m bench.kv_fixtures --write"


def test_every_view_vllm_builds_is_accepted_and_the_cpu_builds_is_read_in_place():
    """Each case vLLM can build is read by ``KVLayout``; the CPU backend's only layout
    (LBHNC, unsplit) is contiguous and its entries are its memory, byte for byte: the
    entries the CPU build wrote before stay valid."""
    import torch

    from bench.conformance_views import views_over
    from cache.vllm.kv_copy import BlockCopier

    cases = kv_fixtures.load()["cases"]
    built = {n: c for n, c in cases.items() if "views" in c}
    assert len(built) == 50 and {n.split("/")[0] for n in cases if n not in built} == {"gqa_bf16_kernel_split"}
    for name, case in built.items():
        meta = torch.empty(case["buffer_bytes"], dtype=torch.int8, device="meta")
        layout = KVLayout.of(views_over(case, meta), case["num_blocks"])
        assert layout.split == (4 if "kernel_split" in name else 1), name
    cpu = cases["gqa_bf16/LBHNC"]
    raw = torch.randint(-128, 128, (cpu["buffer_bytes"],), dtype=torch.int8)
    views = views_over(cpu, raw)
    copier = BlockCopier(views, KVLayout.of(views, cpu["num_blocks"]))
    assert copier.placeable
    entry = copier.gather([3, 4])
    first = views[cpu["views"][0]["name"]]
    start = first.storage_offset() * first.element_size() + 3 * copier.layout.block_bytes()
    assert torch.equal(entry[0].view(torch.int8).reshape(-1), raw[start : start + 2 * copier.layout.block_bytes()])
