"""``pdserve launch``: a real 1P1D cluster (default model, small KV pool) serves a chat
completion through the router and leaves no process behind on SIGTERM; a server
that cannot start stops the rest; bad arguments fail before anything starts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from pdserve.entrypoints.flags import build_serve_parser
from pdserve.entrypoints.cluster import Cluster, LaunchConfig, plan, split_cpus, with_kv_key
from pdserve.entrypoints.launch_plan import planner_args_with_admin_key, with_admin_key
from pdserve.entrypoints.launch_flags import parse_launch_args

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PDSERVE_NUM_THREADS": "1"}


def launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.entrypoints.cli", "launch", "--port", "0", *args]


def stop(proc: subprocess.Popen) -> None:
    """A launch that is still running gets SIGTERM (it stops its cluster), then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(12)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def live(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(e))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def cpus_of(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return re.search(r"Cpus_allowed_list:\s*(\S+)", f.read()).group(1)


def read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> tuple[re.Match, str]:
    """Lines of proc's stdout until one matches (os.read with a deadline: no thread, no hang)."""
    import select

    buf, deadline = "", time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, buf)
        if m:
            return m, buf
        r, _, _ = select.select([proc.stdout], [], [], 1.0)
        if r:
            chunk = os.read(proc.stdout.fileno(), 65536).decode(errors="replace")
            if not chunk:
                break
            buf += chunk
    raise AssertionError(f"no {pattern!r} in launch output:\n{buf}")


@pytest.mark.timeout(300)
def test_launch_serves_a_chat_completion_and_stops_with_nothing_left(tmp_path):
    proc = subprocess.Popen(
        launch_cmd("--max-total-tokens", "512", "--cpu-split", "auto", "--log-dir", str(tmp_path)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, start_new_session=True,
    )
    try:
        _, out = read_until(proc, r"Ctrl-C stops the cluster", 270)
        url = re.search(r"cluster ready: (http://\S+)", out).group(1)
        assert "curl -s " + url + "/v1/chat/completions" in out
        pids = {name: int(pid) for name, pid in re.findall(r"^  (\S+)\s+http://\S+.*pid (\d+)$", out, re.M)}
        assert set(pids) == {"prefill-0", "decode-0", "router"}, out
        if len(os.sched_getaffinity(0)) >= 2:  # --cpu-split auto: each server on its own cores
            assert cpus_of(pids["prefill-0"]) != cpus_of(pids["decode-0"])
        model = json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))["data"][0]["id"]
        body = json.dumps({"model": model, "max_tokens": 6, "temperature": 0,
                           "messages": [{"role": "user", "content": "Say hi"}]}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        resp = json.load(urllib.request.urlopen(req, timeout=120))
        assert resp["usage"]["completion_tokens"] == 6
        assert resp["choices"][0]["message"]["content"]
        started = descendants(proc.pid)
        assert len(started) >= 5  # 3 processes + a scheduler rank per server at least
        assert sorted(os.listdir(tmp_path)) == ["decode-0.log", "prefill-0.log", "router.log"]

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0  # a clean exit of the whole tree (its children are checked next)
        time.sleep(0.3)
        assert [p for p in started if live(p)] == []
    finally:
        stop(proc)


@pytest.mark.timeout(200)
def test_a_server_that_fails_to_start_stops_the_others(tmp_path):
    bad_model = tmp_path / "not-a-model"
    bad_model.mkdir()
    (bad_model / "config.json").write_text('{"architectures": ["NoSuchModel"]}')
    proc = subprocess.Popen(launch_cmd("--model-path", str(bad_model), "--log-dir", str(tmp_path / "logs")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        stop(proc)
    assert proc.returncode == 1, (out, err)
    err = err.decode()
    assert re.search(r"(prefill|decode)-0 exited with code", err), err
    assert "last lines of" in err and "\n" in err.split("last lines of", 1)[1].strip()
    time.sleep(0.3)
    leftover = []
    for e in os.listdir("/proc"):
        if e.isdigit() and live(int(e)):
            try:
                with open(f"/proc/{e}/cmdline", "rb") as f:
                    if str(bad_model).encode() in f.read():
                        leftover.append(int(e))
            except OSError:
                pass
    assert leftover == []


@pytest.mark.parametrize("args, message", [
    (["--prefill", "0"], "--prefill and --decode must be >= 1"),
    (["--cpu-split", "half"], "invalid choice: 'half'"),
    (["--model-path", "/no/such/model"], "no such file or directory"),
    (["--max-total-tokns", "64"], "unrecognized arguments: --max-total-tokns"),  # a typo of a serve flag
    (["--max-total-token", "64"], "unrecognized arguments: --max-total-token"),  # no abbreviations passed on
    (["--disaggregation-mode", "null"], "--disaggregation-mode is set by launch"),
    (["--decode-dp-size", "-1"], "--decode-dp-size must be >= 1"),
])
@pytest.mark.timeout(60)
def test_bad_arguments_exit_with_a_clear_message(args, message):
    proc = subprocess.Popen(launch_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        out, err = proc.communicate(timeout=50)
    finally:
        stop(proc)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert r.returncode == 2
    assert message in r.stderr, r.stderr
    assert "logs in" not in r.stdout  # nothing started


def test_a_launch_off_loopback_gives_its_servers_a_private_key(tmp_path):
    """Servers on a non-loopback host refuse to start without a KV key: launch makes one (0600) and
    passes it to every server, unless the flags name one or opt out."""
    from pdserve.entrypoints.flags import parse_serve_args

    config = with_kv_key(LaunchConfig(host="0.0.0.0", port=0), str(tmp_path))
    key = config.engine_args[config.engine_args.index("--disaggregation-auth-key-file") + 1]
    assert os.stat(key).st_mode & 0o777 == 0o600 and len(open(key).read()) == 64
    for spec in plan(config)[:-1]:
        serve = parse_serve_args(list(spec.argv[3:]))  # what the server parses: no refusal
        assert serve.kv_transfer.auth_key_file == key
    for kept in (LaunchConfig(), LaunchConfig(host="0.0.0.0", engine_args=("--disaggregation-allow-unauthenticated",))):
        assert with_kv_key(kept, str(tmp_path)) is kept


def test_a_launch_off_loopback_gives_router_servers_and_planner_one_admin_key(tmp_path):
    """Off loopback the control routes answer only with the admin key, and the router's fan-out
    sends its own: launch makes one (0600) and hands it as a file to the router and every server
    (the planner's servers too) and to the planner, unless the flags name one."""
    from pdserve.entrypoints.flags import parse_serve_args
    from pdserve.entrypoints.planner.launch_planner import planner_config
    from pdserve.router.cli import build_parser, config_from_args

    cluster = Cluster(LaunchConfig(host="0.0.0.0", port=0, planner=True, planner_args=("--profile", "p.json"),
                                   log_dir=str(tmp_path)))
    config = cluster.config
    key_file = config.router_args[config.router_args.index("--admin-api-key-file") + 1]
    assert os.path.dirname(key_file) == str(tmp_path) and os.stat(key_file).st_mode & 0o777 == 0o600
    key = open(key_file).read()
    assert len(key) == 64
    *servers, router = cluster.specs
    assert config_from_args(build_parser().parse_args(list(router.argv[3:]))).admin_api_key == key
    for spec in servers:
        assert parse_serve_args(list(spec.argv[3:])).admin_api_key == key
    assert parse_serve_args(list(cluster.planner_serve_args())).admin_api_key == key
    planner = planner_config(planner_args_with_admin_key(config), cluster.url, 0, config.host, (), "mooncake",
                             str(tmp_path), 60.0)
    assert planner.admin_api_key == key
    # on loopback, or with a key named for the servers or the router: nothing added
    for kept in (LaunchConfig(), LaunchConfig(host="0.0.0.0", engine_args=("--admin-api-key-file", key_file)),
                 LaunchConfig(host="0.0.0.0", router_args=("--admin-api-key-file=" + key_file,))):
        assert with_admin_key(kept, str(tmp_path)) is kept
    # a router key file the user named reaches the planner as well
    named = LaunchConfig(host="0.0.0.0", router_args=("--admin-api-key-file=" + key_file,), planner=True)
    assert planner_args_with_admin_key(named) == ("--admin-api-key", key)


def test_cpu_split_and_plan():
    assert split_cpus([0, 1, 2, 3, 4], 2) == [(0, 1, 2), (3, 4)]
    assert split_cpus([3, 1], 3) == [(1,), (3,), (1,)]  # more servers than cores: shared, one each
    config = LaunchConfig(prefill=2, decode=1, prefill_dp_size=2, cpu_split="auto", port=0,
                          engine_args=("--dtype", "float32"))
    specs = plan(config)
    assert [s.name for s in specs] == ["prefill-0", "prefill-1", "decode-0", "router"]
    boots = [s.bootstrap_port for s in specs[:2]]
    assert None not in boots and len(set(boots)) == 2
    router = list(specs[-1].argv)
    for s in specs[:2]:
        i = router.index(s.url)
        assert router[i - 1] == "--prefill" and router[i + 1] == str(s.bootstrap_port)
        assert s.argv[s.argv.index("--dp-size") + 1] == "2"
    assert router[router.index(specs[2].url) - 1] == "--decode"
    assert all(s.argv[-2:] == ("--dtype", "float32") for s in specs[:3])
    passed_on = parse_launch_args(["--max-total-tokens", "64"], build_serve_parser).engine_args
    assert passed_on == ("--max-total-tokens", "64")


@pytest.mark.timeout(60)
def test_children_get_sigterm_when_the_launcher_is_killed():
    code = (
        "import time\n"
        "from pdserve.entrypoints.procs import spawn\n"
        "p = spawn(['sleep', '60'], '/dev/null', die_with_parent=True)\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
    child = int(parent.stdout.readline())
    assert live(child)
    parent.kill()  # SIGKILL: the launcher runs no clean-up of its own
    parent.wait()
    deadline = time.monotonic() + 5
    while live(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live(child)
