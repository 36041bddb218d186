#!/usr/bin/env bash
# The transfer experiment: five arms x three task seeds, then one comparison.
#
#   bash examples/transfer/run.sh [--quick] [--store DIR] [--arms a,b,...] [--seeds 1,2,3]
#
# --quick: one seed, 2 updates and small splits (the CI-sized version; its figures say
# that the signals exist, not what they are). Runs already finished in the store are
# skipped, so an interrupted experiment continues where it stopped. HARNESS_S_BIN picks the
# binary (default: harness-s on PATH).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${HARNESS_S_BIN:-harness-s}"
store="harness-s-data"
arms="grpo,h0-rescue,hs-generating,hs-h0,hs-evolved"
seeds="1,2,3"
quick=()
tag="transfer"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) seeds="1"; tag="transfer-quick"
      quick=(--set algorithm.updates=2 --set tasks.generate.train=12 --set tasks.generate.validation=6
             --set tasks.generate.test=6 --set calibration.interval=0 --set evaluation.k=2); shift ;;
    --store) store="$2"; shift 2 ;;
    --arms) arms="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    *) echo "run.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

arm_keys() {
  case "$1" in
    grpo) echo "--set algorithm.rescue=\"none\"" ;;
    h0-rescue) echo "--set algorithm.rescue=\"h0\"" ;;
    hs-generating) echo "--set algorithm.rescue=\"router\"" ;;
    hs-h0) echo "--set algorithm.rescue=\"router\" --set algorithm.rescue_context=\"h0\"" ;;
    hs-evolved) echo "" ;;
    *) echo "run.sh: unknown arm $1" >&2; exit 2 ;;
  esac
}

started=$(date +%s)
compare=()
IFS=, read -ra arm_list <<< "$arms"
IFS=, read -ra seed_list <<< "$seeds"
for arm in "${arm_list[@]}"; do
  runs=()
  spec="$here/arm.toml"
  [[ "$arm" == hs-evolved ]] && spec="$here/evolved.toml"
  for seed in "${seed_list[@]}"; do
    id="$tag-$arm-$seed"
    runs+=("$id")
    if "$bin" status "$id" --store "$store" 2>/dev/null | grep -Eq "^status: +completed"; then
      echo "== $id: done already"; continue
    fi
    echo "== $id ($(( ($(date +%s) - started) / 60 )) min so far)"
    # shellcheck disable=SC2046
    if "$bin" status "$id" --store "$store" >/dev/null 2>&1; then
      "$bin" resume "$id" --store "$store" || [[ $? -eq 3 ]]
    else
      "$bin" run "$spec" --store "$store" --set run.id="\"$id\"" --set run.seed="$((6 + seed))" \
        --set tasks.generate.seed="$((10 + seed))" $(arm_keys "$arm") "${quick[@]}" || [[ $? -eq 3 ]]
    fi
  done
  compare+=(--arm "$arm=$(IFS=,; echo "${runs[*]}")")
done
"$bin" compare --store "$store" "${compare[@]}"
echo "transfer experiment: $(( ($(date +%s) - started) / 60 )) min"
