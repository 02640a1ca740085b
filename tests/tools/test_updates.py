"""``tools/cluster/updates.py`` without a cluster: the config variants it deploys, the retry of a
request that got no stream (and never of one that did), and the comparison with the reference."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.conftest import REPO
from tools.cluster import updates

LOCAL_CPU = REPO / "deployments" / "configs" / "local-cpu.yaml"


def test_each_variant_adds_its_change_to_the_previous_one():
    steps = updates.variants(LOCAL_CPU, ["router", "drafter", "replicas", "limits"])
    assert [what.split("=")[0] for what, _ in steps] == [
        "router.speculation_token_budget",
        "drafter",
        "gateway.replicas",
        "http_limits.max_queue_wait_s",
    ]
    last = steps[-1][1]["applications"][0]["args"]
    assert last["router"]["speculation_token_budget"] == 20 and last["drafter"] == "lookup"
    assert last["gateway"]["autoscaling_config"]["max_replicas"] == 2 and last["http_limits"]["max_queue_wait_s"] == 5
    first = steps[0][1]["applications"][0]["args"]
    assert first["drafter"] == "lookup+outputs"  # earlier documents are not changed by later steps


def sse(tokens: list[list[int]]) -> bytes:
    return "".join(f"data: {json.dumps({'token_ids': t})}\n\n" for t in tokens).encode() + b"data: [DONE]\n\n"


def test_a_request_that_got_no_stream_is_retried_and_a_stream_is_not(monkeypatch):
    monkeypatch.setattr(updates, "BACKOFF_S", 0.0)
    answers = [httpx.Response(500), httpx.Response(200, content=sse([[1, 2], [3]]))]

    def handler(request):
        return answers.pop(0)

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await updates.one_stream(client, "http://x", "p", 3)

    out = asyncio.run(main())
    assert out["tokens"] == [1, 2, 3] and out["retries"] == [500] and out["status"] == 200


def test_rows_say_whether_each_stream_completed_identical_to_its_user_reference():
    ref = [{"tokens": [1, 2, 3], "seconds": 1.0}, {"tokens": [4, 5, 6], "seconds": 1.0}]
    got = {"status": 200, "error": None, "seconds": 2.0, "max_gap_s": 0.5, "retries": []}
    rows = updates.compare(
        ref,
        [(0, {**got, "tokens": [1, 2, 3]}), (1, {**got, "tokens": [4, 5, 7]}), (1, {**got, "tokens": [4, 5]})],
    )
    assert [(r["completed"], r["identical"]) for r in rows] == [(True, True), (True, False), (False, False)]
