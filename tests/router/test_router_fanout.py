"""The router sends SGLang's control operations (/flush_cache, /update_weights_from_disk,
/release_memory_occupation, /resume_memory_occupation) to every worker of both roles, with the
client's body, and reports each worker's result; one failing worker makes the answer 502 and
names it."""

from __future__ import annotations

import pytest

from pdserve.router.fanout import FANOUT_PATHS

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("path", FANOUT_PATHS)
async def test_control_reaches_every_worker(cluster, path):
    await cluster.start(n_prefill=2, n_decode=2)
    body = {"model_path": "/ckpt/b"} if path == "/update_weights_from_disk" else {"tags": ["kv_cache"]}
    status, answer = await cluster.post(path, body)
    assert status == 200 and answer["success"] is True
    workers = cluster.prefills + cluster.decodes
    assert sorted(w["url"] for w in answer["workers"]) == sorted(w.url for w in workers)
    assert {w["role"] for w in answer["workers"]} == {"prefill", "decode"}
    for w in workers:
        got = [r for r in w.requests if r.path == path]
        assert len(got) == 1 and got[0].body == body, w.url


async def test_a_failing_worker_is_named(cluster):
    await cluster.start(n_prefill=1, n_decode=2)
    bad = cluster.decodes[1]
    bad.behavior.control_status = 400
    status, answer = await cluster.post("/flush_cache", {})
    assert status == 502 and answer["success"] is False
    failed = [w for w in answer["workers"] if not w["success"]]
    assert [w["url"] for w in failed] == [bad.url] and failed[0]["status"] == 400
    assert all(len([r for r in w.requests if r.path == "/flush_cache"]) == 1
               for w in cluster.prefills + cluster.decodes)
