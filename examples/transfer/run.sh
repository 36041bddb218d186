#!/usr/bin/env bash
# The transfer experiment: five arms x three task seeds, then one comparison.
#
#   bash examples/transfer/run.sh [--setting DIR] [--gate] [--quick] [--store DIR]
#                                 [--arms a,b,...] [--seeds 1,2,3] [--tag NAME] [--set KEY=VALUE ...]
#
# --setting: the folder of the setting (its arm.toml, h0.json and pool/; default this one;
# examples/transfer-query is the setting whose questions need a query); its folder name is
# the default tag. --gate: before any arm, one run with updates = 0 per seed that measures
# H0 and every sibling on the validation split with the starting policy (the report's
# "Validation success by harness" table), then stops.
# --set: a spec override for every arm (e.g. --set algorithm.learning_rate=2e-5), after the
# arm's own keys; --tag: the prefix of the run ids (default transfer, transfer-quick), so a
# varied setting gets runs of its own in the same store.
# --quick: one seed, 2 updates and small splits (the CI-sized version; its figures say
# that the signals exist, not what they are). Runs already finished in the store are
# skipped, so an interrupted experiment continues where it stopped. HARNESS_S_BIN picks the
# binary (default: harness-s on PATH).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
setting="$here"
gate=""
bin="${HARNESS_S_BIN:-harness-s}"
store="harness-s-data"
arms="grpo,h0-rescue,hs-generating,hs-h0,hs-evolved"
seeds="1,2,3"
quick=()
extra=()
tag="transfer"
tag_given=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) seeds="1"; [[ -n "$tag_given" ]] || tag="transfer-quick"
      quick=(--set algorithm.updates=2 --set tasks.generate.train=12 --set tasks.generate.validation=6
             --set tasks.generate.test=6 --set calibration.interval=0 --set calibration.tasks=6 --set evaluation.k=2); shift ;;
    --setting) setting="$(cd "$2" && pwd)"; shift 2 ;;
    --gate) gate=1; shift ;;
    --store) store="$2"; shift 2 ;;
    --arms) arms="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    --tag) tag="$2"; tag_given=1; shift 2 ;;
    --set) extra+=(--set "$2"); shift 2 ;;
    *) echo "run.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

arm_keys() {
  case "$1" in
    grpo) echo "--set algorithm.rescue=\"none\"" ;;
    h0-rescue) echo "--set algorithm.rescue=\"h0\"" ;;
    hs-generating) echo "--set algorithm.rescue=\"router\"" ;;
    hs-h0) echo "--set algorithm.rescue=\"router\" --set algorithm.rescue_context=\"h0\" --set algorithm.rescue_context_floor=1 --set algorithm.rescue_context_cap=1" ;;
    hs-h0-tis) echo "--set algorithm.rescue=\"router\" --set algorithm.rescue_context=\"h0\" --set algorithm.rescue_context_floor=0 --set algorithm.rescue_context_cap=2" ;;
    hs-evolved) echo "" ;;
    *) echo "run.sh: unknown arm $1" >&2; exit 2 ;;
  esac
}

[[ -n "$tag_given" || "$setting" == "$here" ]] || tag="$(basename "$setting")${quick:+-quick}"
[[ -f "$setting/arm.toml" ]] || { echo "run.sh: $setting has no arm.toml" >&2; exit 2; }

if [[ -n "$gate" ]]; then
  IFS=, read -ra seed_list <<< "$seeds"
  for seed in "${seed_list[@]}"; do
    id="$tag-gate-$seed"
    if ! "$bin" status "$id" --store "$store" 2>/dev/null | grep -Eq "^status: +completed"; then
      echo "== $id (updates = 0)"
      "$bin" run "$setting/arm.toml" --store "$store" --set run.id="\"$id\"" --set run.seed="$((6 + seed))" --set calibration.tasks=16 \
        --set tasks.generate.seed="$((10 + seed))" --set algorithm.updates=0 "${extra[@]}" || [[ $? -eq 3 ]]
    fi
    "$bin" report "$id" --store "$store" >/dev/null
    "$bin" store cat "runs/$id/reports/report.md" --store "$store" | sed -n '/^## Validation success by harness/,/^## /p' | sed '$d'
  done
  exit 0
fi

started=$(date +%s)
IFS=, read -ra arm_list <<< "$arms"
IFS=, read -ra seed_list <<< "$seeds"
for arm in "${arm_list[@]}"; do arm_keys "$arm" >/dev/null; done
# Seed by seed, every arm within a seed: an experiment stopped early has the same seeds in
# every arm.
for seed in "${seed_list[@]}"; do
  for arm in "${arm_list[@]}"; do
    id="$tag-$arm-$seed"
    spec="$setting/arm.toml"
    [[ "$arm" == hs-evolved ]] && spec="$setting/evolved.toml"
    if "$bin" status "$id" --store "$store" 2>/dev/null | grep -Eq "^status: +completed"; then
      echo "== $id: done already"; continue
    fi
    echo "== $id ($(( ($(date +%s) - started) / 60 )) min so far)"
    if "$bin" status "$id" --store "$store" >/dev/null 2>&1; then
      "$bin" resume "$id" --store "$store" || [[ $? -eq 3 ]]
    else
      # shellcheck disable=SC2046
      "$bin" run "$spec" --store "$store" --set run.id="\"$id\"" --set run.seed="$((6 + seed))" \
        --set tasks.generate.seed="$((10 + seed))" $(arm_keys "$arm") "${quick[@]}" "${extra[@]}" || [[ $? -eq 3 ]]
    fi
  done
done
compare=()
for arm in "${arm_list[@]}"; do
  runs=()
  for seed in "${seed_list[@]}"; do runs+=("$tag-$arm-$seed"); done
  compare+=(--arm "$arm=$(IFS=,; echo "${runs[*]}")")
done
"$bin" compare --store "$store" "${compare[@]}"
echo "transfer experiment: $(( ($(date +%s) - started) / 60 )) min"
