#!/usr/bin/env bash
# A local Redis Cluster of masters only (no replicas) on 127.0.0.1, for CI, tests and development.
#
#   deploy/redis_cluster.sh start PORT...      start what is not running, create the cluster when its nodes are new,
#                                              wait for cluster_state:ok on every node (idempotent: a running
#                                              cluster is reused; a restarted node rejoins from its nodes file)
#   deploy/redis_cluster.sh kill-node PORT     stop one node, keeping its nodes file (it rejoins on `start`)
#   deploy/redis_cluster.sh stop PORT...       stop the nodes and delete their nodes files (a later start is new)
#
# Files go to $KDAMESH_REDIS_CLUSTER_DIR (default /tmp/kdamesh-redis-cluster). Nodes keep nothing on disk
# (--save '' --appendonly no): a restarted node is empty, as a restarted single Redis is. Every wait has a deadline.
# Exit status 2 with a message when redis-server / redis-cli are missing; 1 when the cluster does not come up.
set -euo pipefail

DIR="${KDAMESH_REDIS_CLUSTER_DIR:-/tmp/kdamesh-redis-cluster}"
WAIT_S="${KDAMESH_REDIS_CLUSTER_WAIT_S:-30}"

die() { echo "redis_cluster.sh: $*" >&2; exit 1; }
need() {
  command -v "$1" >/dev/null 2>&1 || { echo "redis_cluster.sh: needs $1 on PATH (apt-get install redis-server)" >&2; exit 2; }
}
cli() { local port=$1; shift; redis-cli -h 127.0.0.1 -p "$port" "$@" 2>/dev/null; }
info_field() { cli "$1" cluster info | tr -d '\r' | sed -n "s/^$2://p"; }

start_node() {
  local port=$1
  if cli "$port" ping | grep -q PONG; then
    [ "$(cli "$port" info cluster | tr -d '\r' | sed -n 's/^cluster_enabled://p')" = 1 ] \
      || die "127.0.0.1:$port runs a Redis without cluster mode; stop it or pick other ports"
    return 0
  fi
  redis-server --bind 127.0.0.1 --port "$port" --cluster-enabled yes --cluster-config-file "$DIR/nodes-$port.conf" \
    --cluster-node-timeout 2000 --cluster-require-full-coverage no --save '' --appendonly no --dir "$DIR" \
    --pidfile "$DIR/redis-$port.pid" --logfile "$DIR/redis-$port.log" --daemonize yes >/dev/null
  local deadline=$((SECONDS + 10))
  until cli "$port" ping | grep -q PONG; do
    [ "$SECONDS" -lt "$deadline" ] || die "node 127.0.0.1:$port did not answer PING within 10 s (see $DIR/redis-$port.log)"
    sleep 0.1
  done
}

all_ok() {
  local port
  for port in "$@"; do
    [ "$(info_field "$port" cluster_state)" = ok ] || return 1
    [ "$(info_field "$port" cluster_known_nodes)" = "$#" ] || return 1
    [ "$(info_field "$port" cluster_slots_ok)" = 16384 ] || return 1  # every slot served, as this node sees it
    cli "$port" cluster nodes | grep -q 'fail' && return 1
  done
  return 0
}

start() {
  [ "$#" -ge 1 ] || die "start needs the ports of the nodes"
  need redis-server; need redis-cli
  mkdir -p "$DIR"
  local port fresh=1
  for port in "$@"; do start_node "$port"; done
  for port in "$@"; do
    [ "$(info_field "$port" cluster_known_nodes)" = 1 ] && [ "$(info_field "$port" cluster_slots_assigned)" = 0 ] || fresh=0
  done
  if [ "$fresh" = 1 ]; then
    local nodes=()
    for port in "$@"; do nodes+=("127.0.0.1:$port"); done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >/dev/null \
      || die "redis-cli --cluster create ${nodes[*]} failed"
  fi
  local deadline=$((SECONDS + WAIT_S))
  until all_ok "$@"; do
    [ "$SECONDS" -lt "$deadline" ] || die "cluster on ports $* not ok within ${WAIT_S} s (cluster_state: $(info_field "$1" cluster_state))"
    sleep 0.2
  done
  echo "redis cluster ok on 127.0.0.1 ports $*"
}

kill_node() {
  need redis-cli
  cli "$1" shutdown nosave >/dev/null || true
  local deadline=$((SECONDS + 10))
  while cli "$1" ping | grep -q PONG; do
    [ "$SECONDS" -lt "$deadline" ] || die "node 127.0.0.1:$1 did not stop within 10 s"
    sleep 0.1
  done
}

stop() {
  local port
  for port in "$@"; do
    kill_node "$port"
    rm -f "$DIR/nodes-$port.conf" "$DIR/redis-$port.pid"
  done
}

cmd="${1:-}"; shift || true
case "$cmd" in
  start) start "$@" ;;
  kill-node) [ "$#" = 1 ] || die "kill-node needs one port"; kill_node "$1" ;;
  stop) stop "$@" ;;
  *) echo "usage: $0 start|kill-node|stop PORT..." >&2; exit 64 ;;
esac
