"""Config validation, the CLI (defaults from RouterConfig, --prefill URL [PORT]), backoff."""

import random
import subprocess
import sys
from dataclasses import fields

import pytest

from pdserve.router.admission import Admission
from pdserve.router.cli import build_parser, config_from_args
from pdserve.router.config import RouterConfig, WorkerSpec, backoff_ms
from pdserve.router.errors import RouterError
from pdserve.router.policy import POLICIES


def parse(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_cli_defaults_are_the_config_defaults():
    cfg = parse()
    for f in fields(RouterConfig):
        assert getattr(cfg, f.name) == f.default, f.name


def test_prefill_url_with_optional_bootstrap_port():
    cfg = parse("--pd-disaggregation", "--prefill", "http://198.51.100.1:30000", "8998",
                "--prefill", "http://198.51.100.2:30000", "none", "--prefill", "http://198.51.100.3:30000",
                "--decode", "http://198.51.100.4:30001", "--decode", "http://198.51.100.5:30001",
                "--policy", "power_of_two", "--prefill-policy", "cache_aware", "--dp-aware",
                "--api-key", "k", "--max-concurrent-requests", "8", "--disable-retries")
    assert [(s.url, s.bootstrap_port) for s in cfg.prefill] == [
        ("http://198.51.100.1:30000", 8998), ("http://198.51.100.2:30000", None),
        ("http://198.51.100.3:30000", None)]
    assert [s.url for s in cfg.decode] == ["http://198.51.100.4:30001", "http://198.51.100.5:30001"]
    assert cfg.effective_prefill_policy == "cache_aware" and cfg.effective_decode_policy == "power_of_two"
    assert cfg.dp_aware and cfg.api_key == "k" and cfg.max_concurrent_requests == 8
    assert cfg.retry_max_retries == 1


@pytest.mark.parametrize("argv", [
    ["--prefill", "http://a:1", "1", "2"],
    ["--prefill", "a:1"],
    ["--policy", "nope"],
    ["--max-concurrent-requests", "0"],
    ["--retry-max-retries", "0"],
    ["--prefill", "http://a:1", "70000"],
    ["--max-connections", "0"],
    ["--http-header-timeout", "0"],
    ["--http-read-timeout", "-1"],
])
def test_bad_flags_fail_at_start(argv):
    with pytest.raises((SystemExit, ValueError)):
        parse(*argv)


def test_unknown_policy_is_a_cli_error_before_anything_starts():
    # a fresh interpreter: the router's server module (and so its sockets) must not be reached
    code = ("import sys\nfrom pdserve.entrypoints.cli import main\ntry:\n    main(sys.argv[1:])\nfinally:\n"
            "    print('server imported:', 'pdserve.router.server' in sys.modules)\n")
    for flag in ("--policy", "--prefill-policy", "--decode-policy"):
        out = subprocess.run([sys.executable, "-c", code, "router", flag, "troch"], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 2, out
        assert f"{flag}: invalid choice: 'troch'" in out.stderr
        assert all(repr(name) in out.stderr for name in POLICIES), out.stderr  # the choices are named
        assert "server imported: False" in out.stdout


def test_config_rejects_a_prefill_spec_as_decode():
    with pytest.raises(ValueError):
        RouterConfig(decode=(WorkerSpec("http://a:1", "prefill"),))


def test_backoff_grows_and_is_capped_with_bounded_jitter():
    cfg = RouterConfig(retry_initial_backoff_ms=50, retry_backoff_multiplier=2, retry_max_backoff_ms=300,
                       retry_jitter_factor=0.2)
    assert backoff_ms(cfg, 1, 0.5) == 50 and backoff_ms(cfg, 2, 0.5) == 100
    assert backoff_ms(cfg, 10, 0.5) == 300
    rng = random.Random(0)
    delays = [backoff_ms(cfg, 1, rng.random()) for _ in range(1000)]
    assert 40 <= min(delays) < 45 and 55 < max(delays) <= 60


async def test_admission_queue_hands_slots_over_in_order_and_times_out():
    import asyncio
    adm = Admission(max_concurrent=1, queue_size=2, queue_timeout_secs=0.2)
    await adm.acquire()
    order = []

    async def waiter(i):
        await adm.acquire()
        order.append(i)

    tasks = [asyncio.ensure_future(waiter(i)) for i in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(RouterError) as e:  # queue full
        await adm.acquire()
    assert e.value.status == 429
    adm.release()
    await asyncio.sleep(0.01)
    assert order == [0] and adm.active == 1
    adm.release()
    await asyncio.sleep(0.01)
    assert order == [0, 1]
    await asyncio.gather(*tasks)
    with pytest.raises(RouterError) as e:  # waits past the timeout
        await adm.acquire()
    assert e.value.status == 429 and "queue" in e.value.message
    adm.release()
    assert adm.active == 0 and adm.queued == 0
