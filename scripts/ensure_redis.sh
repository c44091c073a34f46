#!/usr/bin/env bash
# Makes sure a Redis answers at REDIS_URL (default redis://127.0.0.1:6379/0).
# If none does, starts one: in the foreground's background with its pid in var/redis.pid when
# called with --owned (make run stops it on exit, after its workers), daemonized otherwise (CI,
# make test).
set -euo pipefail
cd "$(dirname "$0")/.."
url="${REDIS_URL:-redis://127.0.0.1:6379/0}"
py="${PY:-.venv/bin/python}"
[ -x "$py" ] || py=python3

ping() {
  "$py" - "$url" <<'PYEOF' >/dev/null 2>&1
import socket, sys
from urllib.parse import urlsplit
u = urlsplit(sys.argv[1])
s = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), timeout=1)
s.sendall(b"PING\r\n")
sys.exit(0 if s.recv(64).startswith((b"+PONG", b"-NOAUTH")) else 1)
PYEOF
}

if ping; then exit 0; fi

host_port=$("$py" -c "from urllib.parse import urlsplit; import sys; u=urlsplit(sys.argv[1]); print(u.hostname or '127.0.0.1', u.port or 6379)" "$url")
read -r host port <<<"$host_port"
case "$host" in 127.*|localhost|::1) ;; *)
  echo "No Redis answers at $host:$port, and it is not on this machine: start it there, or set REDIS_URL." >&2
  exit 1;;
esac

if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "Installing Redis (Debian's redis-server package)..."
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null || {
      apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null; }
  else
    echo "No Redis answers at $host:$port and redis-server is not installed." >&2
    echo "Install it (Debian/Ubuntu: sudo apt-get install redis-server; macOS: brew install redis)" >&2
    echo "or point REDIS_URL at a running Redis." >&2
    exit 1
  fi
fi

mkdir -p var
if [ "${1:-}" = "--owned" ]; then
  # In a session of its own where setsid exists (Linux): a Ctrl-C in the terminal reaches make
  # run's processes, not this Redis, so the workers still deregister in it while they stop;
  # make run stops it last.
  detach=()
  command -v setsid >/dev/null 2>&1 && detach=(setsid)
  ${detach[@]+"${detach[@]}"} redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no --dir var \
    >var/redis.log 2>&1 &
  echo $! > var/redis.pid
else
  redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no --dir "$PWD/var" \
    --logfile "$PWD/var/redis.log"
fi
for _ in $(seq 50); do ping && { echo "Started Redis on $host:$port."; exit 0; }; sleep 0.1; done
echo "Redis did not start; see var/redis.log" >&2
exit 1
