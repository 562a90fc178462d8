#!/usr/bin/env bash
# Installs the system packages trainyard's local stack and tests need, when missing: redis-server, and
# chromium + chromium-driver for the dashboard's browser tests, prometheus (+ promtool) for `make observe` and
# the alert-rule tests, nftables for sandboxed node agents.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
# the dashboard's browser tests (tests/browser): headless Chromium driven through Selenium
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
# `make observe` (TRAINYARD_PROMETHEUS=1) and tests/integration/test_prometheus_*.py: prometheus and promtool
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# Redis high availability (`TRAINYARD_REDIS_HA=1 make up`, tests/integration/test_redis_failover.py): Sentinel
command -v redis-sentinel >/dev/null 2>&1 || need+=(redis-sentinel)
# sandboxed ranks kept off the control plane (TRAINYARD_NODE_RANK_BLOCKED, which `make up` sets): nftables rules
# the node agent installs; under enforce an agent without `nft` refuses to start (tests/security/test_rank_network.py)
command -v nft >/dev/null 2>&1 || need+=(nftables)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${need[*]} with apt-get…"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq "${need[@]}" >/dev/null
  # Debian starts a system redis on 6379 on install; ours runs on its own port, stop theirs.
  (command -v systemctl >/dev/null && systemctl stop redis-server 2>/dev/null) || true
  (service redis-server stop >/dev/null 2>&1) || true
  # the same for Debian's prometheus (:9090) and the node exporter it recommends (:9100): ours runs per stack
  (command -v systemctl >/dev/null && systemctl stop prometheus prometheus-node-exporter 2>/dev/null) || true
  (service prometheus stop >/dev/null 2>&1; service prometheus-node-exporter stop >/dev/null 2>&1) || true
  # and Debian's sentinel (:26379): the HA setups start their own sentinels
  (command -v systemctl >/dev/null && systemctl stop redis-sentinel 2>/dev/null) || true
  (service redis-sentinel stop >/dev/null 2>&1) || true
elif [[ " ${need[*]} " == *" redis-server "* ]]; then
  echo "trainyard needs: ${need[*]}" >&2
  echo "install it with your package manager, e.g.: sudo apt-get install -y ${need[*]}" >&2
  echo "or point TRAINYARD_REDIS_URL at an existing Redis server." >&2
  exit 1
else
  # no redis-server is missing: the stack runs; the browser tests fail saying what to install, the Prometheus
  # tests skip, the Sentinel tests fall back to redis-server --sentinel, the rank network tests skip (and a
  # sandboxed node agent needs root anyway)
  echo "trainyard: not installed (not root): ${need[*]} — the browser tests, make observe," \
       "TRAINYARD_REDIS_HA and sandboxed node agents (nftables) need them: sudo apt-get install -y ${need[*]}" >&2
fi
