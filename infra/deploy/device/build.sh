#!/usr/bin/env bash
# Builds the CUDA `harness-s` for a GPU machine whose Python has torch 2.11.0+cu130 (and the
# nvidia/*/lib wheels) but no Rust, and packs what infra/deploy/device/probe.sh needs into
# .device/ (ignored by git), under the 64 MiB a device call carries.
#
#   bash infra/deploy/device/build.sh STORE RUN [STEP]
#
# STORE/RUN/STEP: a local run whose step STEP (default 1) has retained groups (for example
# the quickstart's: `harness-s run examples/quickstart.toml` writes ./harness-s-data); its
# groups and trajectories of that step and the tokenizer of one of its checkpoints are
# packed for the replayed GRPO step.
#
# Versions, matched to the device image and recorded in .device/VERSIONS:
#   torch 2.11.0 (the image's, CUDA 13.0) -> libtorch from the torch 2.11.0 cp312
#   manylinux_2_28 wheel (its lib/ and include/ only); tch 0.24.0, the tch release for
#   libtorch 2.11.0 (the workspace pins tch 0.26.0 for the CPU libtorch 2.13.0, so the build
#   runs on a copy of the tree with tch pinned to 0.24.0).
# The binary links with --allow-shlib-undefined (the CUDA runtime libraries are resolved on
# the device from torch/lib and nvidia/*/lib through LD_LIBRARY_PATH, which probe.sh sets),
# is stripped and xz-compressed (about 13 MB).
# Takes about 20 minutes on 2 cores (a release build) and 2.5 GB of downloads and disk.
set -euo pipefail
cd "$(dirname "$0")/../../.."
ROOT=$PWD
STORE=${1:?usage: build.sh STORE RUN [STEP]}
RUN=${2:?usage: build.sh STORE RUN [STEP]}
STEP=${3:-1}
TORCH=2.11.0
TCH=0.24.0
WORK=${HARNESS_S_CUDA_WORK:-/var/tmp/harness-s-cuda}
OUT=$ROOT/.device
mkdir -p "$WORK" "$OUT"

say() { echo "build.sh: $*" >&2; }

STORE_DIR=${STORE#file://}
[ -d "$STORE_DIR/runs/$RUN" ] || { echo "build.sh: no run \`$RUN\` in $STORE_DIR (runs/$RUN is missing)" >&2; exit 1; }

# 1. libtorch with CUDA from the torch wheel (lib/ and include/ only).
LIBTORCH_CUDA=$WORK/libtorch-$TORCH
if [ ! -f "$LIBTORCH_CUDA/.complete" ]; then
  say "downloading torch==$TORCH (cp312, manylinux_2_28) for its libtorch"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --dest "$WORK/wheels" "torch==$TORCH"
  rm -rf "$LIBTORCH_CUDA" && mkdir -p "$LIBTORCH_CUDA"
  (cd "$WORK" && python3 -m zipfile -e wheels/torch-$TORCH-*.whl unpacked)
  mv "$WORK/unpacked/torch/lib" "$WORK/unpacked/torch/include" "$LIBTORCH_CUDA/"
  [ -d "$WORK/unpacked/torch/share" ] && mv "$WORK/unpacked/torch/share" "$LIBTORCH_CUDA/"
  rm -rf "$WORK/unpacked" "$WORK/wheels"
  [ -f "$LIBTORCH_CUDA/lib/libtorch_cuda.so" ] || { echo "build.sh: the wheel has no libtorch_cuda.so" >&2; exit 1; }
  echo "$TORCH" > "$LIBTORCH_CUDA/.complete"
fi

# 2. The tree (tracked and new files, as they are now) with tch pinned to the image's libtorch.
SRC=$WORK/src
rm -rf "$SRC" && mkdir -p "$SRC"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$SRC" 2>/dev/null || true
sed -i "s/^tch = \"[0-9.]*\"/tch = \"$TCH\"/" "$SRC/Cargo.toml"
(cd "$SRC" && cargo update --quiet -p tch --precise "$TCH" 2>/dev/null || cargo update --quiet -p tch)

# 3. Release build with the cuda feature.
say "cargo build --release -p harness-s --features cuda (tch $TCH, libtorch $TORCH)"
(cd "$SRC" && LIBTORCH=$LIBTORCH_CUDA LIBTORCH_BYPASS_VERSION_CHECK=1 CARGO_TARGET_DIR=$WORK/target \
  RUSTFLAGS="-C link-arg=-Wl,--allow-shlib-undefined" cargo build --release -p harness-s --features cuda)
BIN=$WORK/target/release/harness-s
strip "$BIN"
xz -T0 -6 -c "$BIN" > "$OUT/harness-s.xz"
# The plots' font libraries (fontconfig, freetype and theirs), which slim GPU images may
# lack; probe.sh puts them last on the library path, so the image's own win.
rm -rf "$OUT/lib" && mkdir -p "$OUT/lib"
ldd "$BIN" | awk '/=> \// {print $3}' | grep -E 'lib(fontconfig|freetype|png16|brotli(dec|common)|expat)\.so' \
  | xargs -r cp -L -t "$OUT/lib"

# 4. The replayed step: its groups and trajectories, and a checkpoint's tokenizer.
rm -rf "$OUT/replay" && mkdir -p "$OUT/replay/store/runs/$RUN"
for part in "groups/step=$STEP" "trajectories/step=$STEP"; do
  [ -d "$STORE_DIR/runs/$RUN/$part" ] || { echo "build.sh: $STORE_DIR/runs/$RUN/$part is missing" >&2; exit 1; }
  mkdir -p "$OUT/replay/store/runs/$RUN/$(dirname "$part")"
  cp -r "$STORE_DIR/runs/$RUN/$part" "$OUT/replay/store/runs/$RUN/$part"
done
# The jobs' done-markers (the learner reads only parts a done-marker commits).
cp -r "$STORE_DIR/runs/$RUN/jobs" "$OUT/replay/store/runs/$RUN/"
TOKDIR=$(find "$STORE_DIR/runs/$RUN/checkpoints" -name tokenizer.json -printf '%h\n' | sort | head -1)
[ -n "$TOKDIR" ] || { echo "build.sh: no checkpoint of \`$RUN\` carries tokenizer.json" >&2; exit 1; }
mkdir -p "$OUT/replay/tokenizer"
cp "$TOKDIR/tokenizer.json" "$OUT/replay/tokenizer/"
[ -f "$TOKDIR/tokenizer_config.json" ] && cp "$TOKDIR/tokenizer_config.json" "$OUT/replay/tokenizer/"
echo "$RUN $STEP" > "$OUT/replay/RUN"

cat > "$OUT/VERSIONS" <<EOF
built $(date -u +%FT%TZ) from $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (with uncommitted changes)')
torch (libtorch) $TORCH, CUDA wheel cp312 manylinux_2_28; tch $TCH; rustc $(rustc --version | cut -d' ' -f2)
replay: run $RUN step $STEP
EOF
say "packed $(du -sh "$OUT" | cut -f1) into $OUT (a device call carries 64 MiB):"
du -ah "$OUT" | sort -h | tail -8 >&2
