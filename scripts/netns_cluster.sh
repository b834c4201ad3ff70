#!/usr/bin/env bash
# The distinct-nodes layout on one machine: a prefill node, a decode node and a
# router node, each in its own network namespace, joined by a bridge, addressed
# from the documentation range 198.51.100.0/24. Runs the very commands the
# README's "Distinct nodes" section shows, sends one chat completion through the
# router, prints the answer and tears everything down (also on failure or Ctrl-C).
#
#   sudo bash scripts/netns_cluster.sh [--transfer-backend mooncake|nixl] [extra `pdserve serve` flags...]
#
# Needs root (ip netns). The KV cache crosses the bridge over TCP (Mooncake's tcp
# protocol; for NIXL, UCX_TLS=tcp so UCX does not take a shared-memory shortcut).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$(pwd)/.venv/bin/python"

BACKEND=mooncake
if [[ "${1:-}" == "--transfer-backend" ]]; then BACKEND="$2"; shift 2; fi
EXTRA=("$@")
[[ ${#EXTRA[@]} -gt 0 ]] || EXTRA=(--max-total-tokens 2048)

TAG="pd$$"                      # unique names: several runs (or tests) may share the machine
BR="${TAG}br"
NET=198.51.100
PREFILL_IP=$NET.11 DECODE_IP=$NET.12 ROUTER_IP=$NET.13
PORT=30000 BOOTSTRAP_PORT=8998 ROUTER_PORT=8000
NODES=(prefill decode router)
declare -A IP=([prefill]=$PREFILL_IP [decode]=$DECODE_IP [router]=$ROUTER_IP)
LOGS="$(mktemp -d /tmp/pdserve-netns-XXXXXX)"

ns() { echo "${TAG}-$1"; }

teardown() {
  local code=$?
  set +e
  for n in "${NODES[@]}"; do  # every process in a namespace is one this script started
    pids=$(ip netns pids "$(ns "$n")" 2>/dev/null); [[ -n "$pids" ]] && kill -TERM $pids 2>/dev/null
  done
  for _ in $(seq 50); do
    left=""; for n in "${NODES[@]}"; do left+=$(ip netns pids "$(ns "$n")" 2>/dev/null); done
    [[ -z "$left" ]] && break; sleep 0.1
  done
  for n in "${NODES[@]}"; do
    pids=$(ip netns pids "$(ns "$n")" 2>/dev/null); [[ -n "$pids" ]] && kill -KILL $pids 2>/dev/null
  done
  sleep 0.2
  for n in "${NODES[@]}"; do ip netns del "$(ns "$n")" 2>/dev/null; ip link del "${TAG}${n:0:1}h" 2>/dev/null; done
  ip link del "$BR" 2>/dev/null
  echo "[netns] torn down (logs in $LOGS)"
  exit $code
}
trap teardown EXIT
trap 'exit 130' INT TERM

# --- the network: one bridge, one veth pair per node ---------------------------------------------
ip link add "$BR" type bridge
ip link set "$BR" up
for n in "${NODES[@]}"; do
  ip netns add "$(ns "$n")"
  ip link add "${TAG}${n:0:1}h" type veth peer name eth0 netns "$(ns "$n")"
  ip link set "${TAG}${n:0:1}h" master "$BR" up
  ip -n "$(ns "$n")" addr add "${IP[$n]}/24" dev eth0
  ip -n "$(ns "$n")" link set eth0 up
  ip -n "$(ns "$n")" link set lo up
done
echo "[netns] nodes: prefill $PREFILL_IP, decode $DECODE_IP, router $ROUTER_IP (bridge $BR)"

run_in() {  # run_in NODE LOGNAME cmd...: in the background, inside the node's namespace
  local node=$1 log=$2; shift 2
  echo "[netns] $node\$ $*"
  ip netns exec "$(ns "$node")" env UCX_TLS=tcp "$@" >"$LOGS/$log.log" 2>&1 &
}

# --- the three nodes: exactly the README's commands ----------------------------------------------
# the KV control plane's shared secret: a PD server on a non-loopback host refuses to start without one
KEY="$LOGS/kv-auth.key"
(umask 077 && head -c 32 /dev/urandom | base64 > "$KEY")
run_in prefill prefill "$PY" -m pdserve.engine --disaggregation-mode prefill \
  --host "$PREFILL_IP" --port $PORT --disaggregation-bootstrap-port $BOOTSTRAP_PORT \
  --disaggregation-auth-key-file "$KEY" --disaggregation-transfer-backend "$BACKEND" "${EXTRA[@]}"
run_in decode decode "$PY" -m pdserve.engine --disaggregation-mode decode \
  --host "$DECODE_IP" --port $PORT --disaggregation-auth-key-file "$KEY" \
  --disaggregation-bootstrap-allowlist "$PREFILL_IP" --disaggregation-transfer-backend "$BACKEND" "${EXTRA[@]}"
# the router marks a worker healthy at its first check, then every --health-check-interval-secs
# (60 s by default): start it once both servers answer, as `pdserve launch` does
ip netns exec "$(ns router)" "$PY" - "$PREFILL_IP" "$DECODE_IP" "$PORT" "$LOGS" <<'EOF'
import os, sys, time, urllib.request

p_ip, d_ip, port, logs = sys.argv[1:]
deadline = time.monotonic() + 600
for name, ip in (("prefill", p_ip), ("decode", d_ip)):
    while True:
        try:
            if urllib.request.urlopen(f"http://{ip}:{port}/health", timeout=2).status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            tail = "".join(open(os.path.join(logs, name + ".log")).readlines()[-20:])
            sys.exit(f"[netns] {name} not healthy in time:\n{tail}")
        time.sleep(0.5)
    print(f"[netns] {name} node healthy at http://{ip}:{port} (seen from the router node)", flush=True)
EOF
run_in router router "$PY" -m pdserve.router \
  --prefill "http://$PREFILL_IP:$PORT" $BOOTSTRAP_PORT --decode "http://$DECODE_IP:$PORT" \
  --host "$ROUTER_IP" --port $ROUTER_PORT

# --- wait for the router to see both workers healthy, then one request from the router node ------
ip netns exec "$(ns router)" "$PY" - "$ROUTER_IP" "$ROUTER_PORT" "$LOGS" <<'EOF'
import json, os, sys, time, urllib.request

ip, port, logs = sys.argv[1], sys.argv[2], sys.argv[3]
base = f"http://{ip}:{port}"
deadline = time.monotonic() + 600
while True:
    try:
        h = json.load(urllib.request.urlopen(base + "/health", timeout=2))
        c = h.get("healthy_endpoints", {})
        if c.get("prefill", 0) >= 1 and c.get("decode", 0) >= 1:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        for name in ("prefill", "decode", "router"):
            print(f"--- {name} log ---\n" + "".join(open(os.path.join(logs, name + ".log")).readlines()[-20:]))
        sys.exit("[netns] cluster did not become healthy in time")
    time.sleep(0.5)
print(f"[netns] router {base} sees prefill and decode healthy", flush=True)
model = json.load(urllib.request.urlopen(base + "/v1/models", timeout=10))["data"][0]["id"]
body = json.dumps({"model": model, "max_tokens": 24, "temperature": 0,
                   "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
t = time.perf_counter()
resp = json.load(urllib.request.urlopen(req, timeout=300))
print(f"[netns] answer ({time.perf_counter() - t:.2f} s, via the router {base}): "
      + repr(resp["choices"][0]["message"]["content"]), flush=True)
EOF
