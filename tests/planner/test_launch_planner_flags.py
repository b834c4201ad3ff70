"""``pdserve launch --planner``'s flags (pure parsing, no server): the planner's own flags pass
through ``--planner-arg`` and are checked before anything starts; the ones launch sets itself,
unknown ones and a missing profile are refused, naming the flag."""

from __future__ import annotations

import logging

import pytest

from pdserve.entrypoints.flags import build_serve_parser
from pdserve.entrypoints.cluster import Cluster, LaunchConfig
from pdserve.entrypoints.launch_flags import parse_launch_args
from pdserve.entrypoints.planner.launch_planner import launch_planner

PROFILE = "--planner-arg=--profile=p.json"


def parse(*argv: str) -> LaunchConfig:
    return parse_launch_args(list(argv), build_serve_parser, launch_planner)


def test_planner_flags_pass_through_to_a_local_planner_over_the_cluster(tmp_path):
    config = parse("--planner", "--planner-port", "9123", PROFILE, "--planner-arg=--max-decode=3",
                   "--planner-arg=--min-prefill=1", "--planner-arg=--cooldown=20", "--planner-arg=--budget=5",
                   "--planner-arg=--planner-max-connections=64", "--max-total-tokens", "2048",
                   "--max-connections", "100", "--port", "8123", "--log-dir", str(tmp_path))
    cluster = Cluster(config, launch_planner)
    serve = cluster.planner_serve_args()
    assert serve[serve.index("--mem-fraction-static") + 1] == "0.125"  # the share of each launch server
    assert serve[-4:] == ("--max-total-tokens", "2048", "--max-connections", "100")
    planner = launch_planner(config.planner_args, cluster.url, config.planner_port, config.host, serve,
                             config.transfer_backend, cluster.log_dir, config.startup_timeout)
    c = planner.config
    assert (c.router, c.connector, c.port, c.log_dir) == ("http://127.0.0.1:8123", "local", 9123, str(tmp_path))
    assert (c.max_decode, c.min_prefill, c.cooldown, c.budget, c.profile) == (3, 1, 20.0, 5.0, "p.json")
    assert c.serve_args == serve and c.leave_servers  # launch stops the planner's servers with its own
    # the planner's own listener limit is its prefixed flag; the bare one stays the servers'
    assert (c.max_connections, c.http_limits.max_connections) == (64, 64)


@pytest.mark.parametrize("argv, message", [
    (("--planner",), "profile"),
    ((PROFILE,), "--planner-arg needs --planner"),
    (("--planner", PROFILE, "--planner-arg=--router=http://x:1"), "--router is set by launch"),
    (("--planner", PROFILE, "--planner-arg=--connector=virtual"), "--connector is set by launch"),
    (("--planner", PROFILE, "--planner-arg=--bogus=1"), "--bogus=1"),
    (("--planner", PROFILE, "--planner-arg=--max-decode=0", "--planner-arg=--min-decode=1"), "min <= max"),
    (("--planner", PROFILE, "--prefill-tp-size", "2"), "one DP and TP size"),
])
def test_bad_planner_flags_are_refused_before_anything_starts(argv, message):
    with pytest.raises(ValueError, match=message):
        parse(*argv)


def test_a_planner_that_cannot_start_fails_the_launch_with_its_reason(tmp_path):
    from pdserve.entrypoints.cluster import LaunchError

    config = parse("--planner", f"--planner-arg=--profile={tmp_path / 'missing.json'}", "--port", "0",
                   "--log-dir", str(tmp_path))
    cluster = Cluster(config, launch_planner)
    with pytest.raises(LaunchError, match="missing.json"):
        cluster.start_planner()
    assert cluster.planner.stop() == []  # nothing was started
    assert "missing.json" in (tmp_path / "planner.log").read_text()
    assert logging.getLogger("pdserve.planner").propagate  # its log file detached again


def test_no_correction_through_launch_turns_the_correction_off(tmp_path):
    """argparse reads any ``--no-`` flag of a boolean as off, so the field is ``correction`` and
    ``--no-correction`` its negation; a ``no_`` boolean field is refused where the flags are made."""
    import argparse
    from dataclasses import dataclass

    from pdserve.entrypoints.flags import add_dataclass_flags

    for extra, want in (((), True), (("--planner-arg=--no-correction",), False)):
        config = parse("--planner", PROFILE, *extra, "--log-dir", str(tmp_path))
        planner = launch_planner(config.planner_args, "http://127.0.0.1:1", config.planner_port, config.host, (),
                                 config.transfer_backend, str(tmp_path), config.startup_timeout)
        assert planner.config.correction is want, extra

    @dataclass
    class Bad:
        no_thing: bool = False

    with pytest.raises(TypeError, match="name it 'thing'"):
        add_dataclass_flags(argparse.ArgumentParser(allow_abbrev=False), Bad, ["no_thing"], helps={})
