"""A model that pools: embeddings through ``/v1/embeddings`` and ``/invocations``.

One server for the module: the generated Llama, run by vLLM as an embedding model
(``SM_VLLM_RUNNER=pooling``, ``SM_VLLM_CONVERT=embed``). The tiered cache stays on
(vLLM gives a pooling model no KV to save; the connector must not get in the way).
"""

from __future__ import annotations

import pytest

from tests.test_server import start_server, stop_server

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path):
    srv = start_server(
        tmp_path_factory.mktemp("pooling"), model_path, {"SM_VLLM_RUNNER": "pooling", "SM_VLLM_CONVERT": "embed"}
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def test_embeddings_on_both_routes(server):
    r = server.client.post("/v1/embeddings", json={"input": ["hello", "world"]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert len(data) == 2 and len(data[0]["embedding"]) == 256  # the model's hidden size
    r = server.post({"input": "hello"})  # /invocations: vLLM's pooling requests, in vLLM's order
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["embedding"] == pytest.approx(data[0]["embedding"], abs=1e-3)
    # a generative shape is refused by name, in the one error shape
    r = server.post({"inputs": "hello"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
    r = server.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "does not serve chat" in r.json()["error"]["message"]
    assert [m["id"] for m in server.client.get("/v1/models").json()["data"]] == ["default-model"]
