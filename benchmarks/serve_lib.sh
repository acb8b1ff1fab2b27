# Shared by the serving benchmarks (source it): a free local port, and waiting for /health.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# wait_healthy URL [TRIES] [PID LOG]: poll URL/health every 0.5 s (TRIES times, default 600);
# with PID, give up at once if that process has died, printing LOG. Exits the script, printing
# LOG's end, if URL is not healthy by then. Both print to stderr (stdout carries the results).
wait_healthy() {
  local url=$1 tries=${2:-600} pid=${3:-} log=${4:-}
  for _ in $(seq "$tries"); do
    curl -sf "$url/health" >/dev/null 2>&1 && return 0
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then cat "$log" >&2; exit 1; fi
    sleep 0.5
  done
  echo "$url/health did not answer after $tries tries" >&2
  if [ -n "$log" ]; then tail -n 20 "$log" >&2; fi
  exit 1
}
