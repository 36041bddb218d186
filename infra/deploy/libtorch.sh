#!/usr/bin/env bash
# Assembles a CPU-only libtorch 2.13.0 (the version tch 0.26.0 needs) from PyPI wheels,
# without pulling the 4.7 GB of CUDA packages a full `pip install torch` brings.
#
# PyPI's torch==2.13.0 wheel is the CUDA build: its libtorch_cpu.so still needs
# libcudart.so.13 and libcupti.so.13 at load time, so those two come from their own small
# wheels. The wheel's libtorch.so links libtorch_cuda.so; tch links `-ltorch`, so an empty
# shared library named libtorch.so stands in for it, and libtorch_cuda.so is left out
# (torch-sys would link it when present).
#
# Usage: infra/deploy/libtorch.sh            # installs into $LIBTORCH or /var/tmp/harness-s-libtorch
#        eval "$(infra/deploy/libtorch.sh)"  # and exports LIBTORCH / LD_LIBRARY_PATH
# Idempotent: a complete directory (marked by .complete) is reused.
# For GPU machines use a full torch install instead (LIBTORCH_USE_PYTORCH=1) and build
# with `--features cuda`.
set -euo pipefail

TORCH_VERSION=2.13.0
DEST="${LIBTORCH:-/var/tmp/harness-s-libtorch}"

emit() {
  echo "export LIBTORCH=$DEST"
  echo "export LD_LIBRARY_PATH=$DEST/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
}

if [[ -f "$DEST/.complete" ]] && [[ "$(cat "$DEST/.complete")" == "$TORCH_VERSION" ]]; then
  emit
  exit 0
fi

command -v python3 >/dev/null || { echo "libtorch.sh: python3 (with pip) is required" >&2; exit 1; }
command -v cc >/dev/null || { echo "libtorch.sh: a C compiler (cc) is required for the libtorch.so stub" >&2; exit 1; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/libtorch-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

echo "libtorch.sh: downloading torch==$TORCH_VERSION and the two CUDA runtime wheels" >&2
python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$WORK/wheels" \
  "torch==$TORCH_VERSION" "nvidia-cuda-runtime==13.0.96.*" "nvidia-cuda-cupti==13.0.85.*" >&2

STAGE="$WORK/libtorch"
mkdir -p "$STAGE/lib" "$WORK/x"
python3 - "$WORK/wheels" "$STAGE" <<'PY' >&2
import glob, os, shutil, sys, zipfile
wheels, stage = sys.argv[1], sys.argv[2]
want_libs = {"libtorch_cpu.so", "libc10.so", "libgomp.so.1", "libcudart.so.13", "libcupti.so.13"}
found = set()
for whl in glob.glob(os.path.join(wheels, "*.whl")):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            base = os.path.basename(name)
            if name.startswith("torch/include/") and not name.endswith("/"):
                dst = os.path.join(stage, "include", name[len("torch/include/"):])
            elif base in want_libs or (base.startswith("libgomp") and base.endswith(".so.1")):
                dst = os.path.join(stage, "lib", base if not base.startswith("libgomp") else base)
                found.add(base)
            else:
                continue
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with z.open(name) as src, open(dst, "wb") as out:
                shutil.copyfileobj(src, out)
missing = {l for l in want_libs if l != "libgomp.so.1"} - found
if missing:
    sys.exit(f"libtorch.sh: the wheels lack {sorted(missing)}")
print("libtorch.sh: extracted", sorted(found))
PY

# libgomp ships under a hashed name in the torch wheel (torch.libs/libgomp-<hash>.so.1);
# libtorch_cpu.so's NEEDED entry uses that exact name, so keep it and add the plain alias.
if ! ls "$STAGE/lib"/libgomp*.so.1 >/dev/null 2>&1; then
  echo "libtorch.sh: no libgomp found in the torch wheel" >&2
  exit 1
fi
gomp="$(ls "$STAGE/lib"/libgomp*.so.1 | head -n1)"
[[ -e "$STAGE/lib/libgomp.so.1" ]] || ln -s "$(basename "$gomp")" "$STAGE/lib/libgomp.so.1"

echo 'void harness_s_libtorch_stub(void) {}' > "$WORK/stub.c"
cc -shared -fPIC -o "$STAGE/lib/libtorch.so" "$WORK/stub.c"
echo "$TORCH_VERSION" > "$STAGE/build-version"

mkdir -p "$(dirname "$DEST")"
rm -rf "$DEST.partial"
mv "$STAGE" "$DEST.partial"
rm -rf "$DEST"
mv "$DEST.partial" "$DEST"
echo "$TORCH_VERSION" > "$DEST/.complete"
echo "libtorch.sh: libtorch $TORCH_VERSION (CPU) ready in $DEST" >&2
emit
