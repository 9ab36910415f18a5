"""The GPU conformance suite's report (``bench.gpu_conformance``): one markdown page."""

from __future__ import annotations

TARGET = 0.80  # the bar: a 256-token Llama 3 8B chunk at 80 % of the link


def _mark(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def _views(v: dict) -> list[str]:
    lines = ["## 1. Exactness on vLLM's views", ""]
    bad = {n: c for n, c in v["cases"].items() if not all(c.values())}
    checks = sorted({k for c in v["cases"].values() for k in c})
    lines.append(
        f"{len(v['cases'])} cases (layout x attention kind x dtype), checks: {', '.join(checks)}: "
        + ("all pass." if not bad else f"**{len(bad)} fail**:")
    )
    lines += [f"- {n}: " + ", ".join(f"{k} {_mark(ok)}" for k, ok in c.items()) for n, c in sorted(bad.items())]
    carried = [(spec, pair, ok) for spec, pairs in v["carry"].items() for pair, ok in pairs.items()]
    failed = [c for c in carried if not c[2]]
    lines += [
        "",
        f"Entries carried across layouts (and kernel splits) of one spec: {len(carried)} pairs, "
        + ("all exact." if not failed else f"**{len(failed)} wrong**:"),
    ]
    lines += [f"- {spec}: {pair}" for spec, pair, _ in failed]
    if v["refused_by_vllm"]:
        lines += ["", "Combinations vLLM itself refuses (never handed to a connector):"]
        lines += [f"- {n}: {msg.splitlines()[0][:160]}" for n, msg in sorted(v["refused_by_vllm"].items())]
    return lines


def _ordering(o: dict) -> list[str]:
    lines = [
        "## 2. Ordering, with teeth",
        "",
        "| check | with the ordering | with it removed (must fail) |",
        "| --- | --- | --- |",
    ]
    for name, r in o.items():
        teeth = "fails (has teeth)" if not r["unordered"] else "**passes: no teeth on this device**"
        lines.append(f"| {name} | {_mark(r['ordered'])} | {teeth} |")
    return lines


def _threads(t: dict) -> list[str]:
    seen = ", ".join(f"{k}: cuda:{v}" for k, v in t["seen"].items())
    note = (
        ""
        if t["distinguishing"]
        else " (one GPU on this machine: device 0 is also the default, so this does not tell a thread "
        "that selected it from one that did not; the unit test tests/test_cuda_order.py does)"
    )
    return [
        "## 3. The worker's device in the cache's threads",
        "",
        f"Copier on cuda:{t['device']} ({t['devices']} device(s)); {seen}: {_mark(t['ok'])}{note}.",
    ]


def _staging(s: dict, gpu: bool) -> list[str]:
    kind = "pinned" if gpu else "plain (CPU build)"
    return [
        "## 4. Staging memory",
        "",
        f"A pool of {s['slots']} slots ({s['pool_bytes']:,} bytes of {kind} memory); {s['gathers']} saves "
        f"issued {'while the compute stream was busy (copies in flight)' if gpu else 'with none written back'}"
        f": {s['gathers'] - s['skipped']} staged, {s['skipped']} "
        f"skipped; high-water mark {s['high_water_slots']} slots ({s['high_water_bytes']:,} bytes). "
        f"torch's pinned allocator: {s['pinned_allocated_by_pool']:,} bytes for the pool, "
        f"{s['pinned_grown_by_gathers']:,} more during the gathers: {_mark(s['ok'])}.",
    ]


def _bandwidth(b: dict, link: dict) -> list[str]:
    lines = [
        "## 5. Bandwidth (Llama 3 8B: 32 layers, 8 KV heads x 128, bf16, 16-token blocks)",
        "",
        f"Link: one contiguous pinned copy of {link['bytes'] / 2**20:.0f} MiB: "
        f"{link['d2h_GBps']:.1f} GB/s device -> host, {link['h2d_GBps']:.1f} GB/s host -> device.",
        "",
        "| layout | entry | gather (device -> staging) | of link | the saving thread's share "
        "| scatter (pageable entry -> device) | of link |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for layout, sizes in b.items():
        for tokens, r in sizes.items():
            g, s = r["gather_GBps"] / link["d2h_GBps"], r["scatter_GBps"] / link["h2d_GBps"]
            lines.append(
                f"| {layout} | {int(tokens):,} tokens, {r['entry_bytes'] / 2**20:.0f} MiB | "
                f"{r['gather_GBps']:.1f} GB/s ({r['gather_s'] * 1e3:.2f} ms) | {g:.0%} | "
                f"{r['enqueue_ms']:.2f} ms | {r['scatter_GBps']:.1f} GB/s ({r['scatter_s'] * 1e3:.2f} ms) "
                f"| {s:.0%} |"
            )
    lines += [
        "",
        f"Target: a 256-token chunk at >= {TARGET:.0%} of the link on the layouts vLLM 0.32 picks for "
        "FlashAttention and FlashInfer (LBNHC; LBHNC on Blackwell).",
    ]
    return lines


def render(result: dict) -> str:
    gpu = result["gpu_part"]
    lines = [
        f"# GPU conformance suite (`python -m bench.gpu_conformance`) on {result['device']}",
        "",
        f"torch {result['torch']}; views recorded with vLLM {result['fixtures_vllm']} "
        "(`bench/fixtures/kv_views.json`). Overall: " + ("**pass**" if result["ok"] else "**FAIL**") + ".",
    ]
    if not gpu:
        lines += [
            "",
            "**GPU part not run: no CUDA device.** Ran the exactness checks on the CPU copy path "
            "(the small cases; Llama 3 8B's views need a device) and the staging check on plain memory; "
            "ordering, device selection and bandwidth need a GPU.",
        ]
    lines += [""] + _views(result["views"])
    if gpu:
        lines += [""] + _ordering(result["ordering"]) + [""] + _threads(result["threads"])
    lines += [""] + _staging(result["staging"], gpu)
    if gpu:
        lines += [""] + _bandwidth(result["bandwidth"], result["link"])
    return "\n".join(lines)
