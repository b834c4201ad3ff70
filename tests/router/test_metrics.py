"""The router's /metrics text: names, labels in declared order, worker gauges read at scrape time,
one registry each."""

from pdserve.router.config import WorkerSpec
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers.worker_registry import WorkerRegistry

P, D = "http://198.51.100.1:30000", "http://198.51.100.2:30001"


def samples(metrics: RouterMetrics) -> dict[str, float]:
    out = {}
    for line in metrics.render().decode().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_names_labels_and_worker_gauges():
    workers = WorkerRegistry()
    workers.add(WorkerSpec(P, "prefill"), healthy=True)
    decode = workers.add(WorkerSpec(D, "decode"))
    decode.endpoints[0].load = 3
    m = RouterMetrics(workers)
    m.requests.inc("/generate", "200")
    m.leg_requests.inc(P, "prefill")
    m.leg_requests.inc(P, "prefill")
    m.leg_errors.inc(D, "decode")
    m.leg_retries.inc(D, "decode")
    m.retries.inc()
    m.ttft.observe(0.003)
    m.e2e.observe(0.2)
    s = samples(m)
    assert s['pdserve_router_requests_total{route="/generate",status="200"}'] == 1
    assert s[f'pdserve_router_worker_requests_total{{worker="{P}",leg="prefill"}}'] == 2
    assert s[f'pdserve_router_worker_errors_total{{worker="{D}",leg="decode"}}'] == 1
    assert s[f'pdserve_router_worker_retries_total{{worker="{D}",leg="decode"}}'] == 1
    assert s["pdserve_router_retries_total"] == 1
    assert s['pdserve_router_ttft_seconds_bucket{le="0.0025"}'] == 0
    assert s['pdserve_router_ttft_seconds_bucket{le="0.005"}'] == 1
    assert s["pdserve_router_ttft_seconds_count"] == 1 and s["pdserve_router_e2e_seconds_sum"] == 0.2
    assert s[f'pdserve_router_worker_in_flight{{worker="{D}",role="decode"}}'] == 3
    assert s[f'pdserve_router_worker_healthy{{worker="{P}",role="prefill"}}'] == 1
    assert s[f'pdserve_router_worker_healthy{{worker="{D}",role="decode"}}'] == 0
    assert not any("_created" in key for key in s)
    m.requests.inc('/x"y\\z', "404")  # label values are escaped
    assert 'pdserve_router_requests_total{route="/x\\"y\\\\z",status="404"} 1.0' in m.render().decode()
    workers.remove(D)  # read when scraped: a removed worker's gauges are gone
    assert not any(D in key and "worker_in_flight" in key for key in samples(m))


def test_each_router_counts_in_its_own_registry():
    a, b = RouterMetrics(WorkerRegistry()), RouterMetrics(WorkerRegistry())
    a.retries.inc()
    assert samples(a)["pdserve_router_retries_total"] == 1
    assert samples(b)["pdserve_router_retries_total"] == 0
