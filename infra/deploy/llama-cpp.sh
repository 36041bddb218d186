#!/usr/bin/env bash
# Installs llama.cpp's Python binding (llama-cpp-python, with its OpenAI-compatible server)
# for the references of the tests and benches: `harness-s bench sampler`/`bench serve`,
# the engine's llama.cpp comparison tests, and the test server of infra/deploy/llama-server.sh.
# The main job does not need it (the model package is installed with --no-deps).
#
#   bash infra/deploy/llama-cpp.sh [PYTHON]      # default: python3
#
# llama.cpp built with native CPU detection enables AMX where the CPU flags list it, and
# some VMs refuse those instructions ("invalid opcode" in libggml-cpu on larger batches,
# a SIGSEGV or SIGILL in the reference). A prebuilt or natively built llama-cpp-python is
# such a build; this rebuilds it from source (about 8 minutes on 2 cores) with the
# instruction sets pinned: AVX2, plus the AVX-512 sets the CPU lists (so the reference is
# as fast as this CPU allows), never AMX. Idempotent: a build without AMX is kept.
# Settings (environment): HARNESS_S_WHEELS, the folder of built wheels (default
# /var/tmp/harness-s-wheels).
set -euo pipefail
PY=${1:-python3}
VERSION=0.3.36

if "$PY" -c "import llama_cpp, sys; sys.exit('AMX' in llama_cpp.llama_print_system_info().decode())" 2>/dev/null \
  && "$PY" -c "import llama_cpp.server.app" 2>/dev/null; then
  echo "llama-cpp.sh: llama-cpp-python $("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)') without AMX is installed" >&2
  exit 0
fi
FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
for f in avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
  if grep -qw "${f%%:*}" /proc/cpuinfo; then FLAGS="$FLAGS -DGGML_${f#*:}=ON"; fi
done
# The built wheel is kept, keyed by version, flags and interpreter, so a rebuilt virtual
# environment (infra/deploy/pyenv.sh) installs it in seconds instead of compiling again.
PYTAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
WHEELS="${HARNESS_S_WHEELS:-/var/tmp/harness-s-wheels}/llama-cpp-python-$VERSION-$PYTAG-$(echo "$FLAGS" | sha256sum | cut -c1-12)"
if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "llama-cpp.sh: building llama-cpp-python $VERSION from source ($FLAGS); about 8 minutes on 2 cores" >&2
  rm -rf "$WHEELS.partial"
  CMAKE_ARGS="$FLAGS" "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-cache-dir \
    --no-binary llama-cpp-python --wheel-dir "$WHEELS.partial" "llama-cpp-python==$VERSION" >&2
  mv "$WHEELS.partial" "$WHEELS"
fi
WHEEL=$(ls "$WHEELS"/llama_cpp_python-*.whl | head -n1)
echo "llama-cpp.sh: installing $WHEEL with its server's dependencies" >&2
# `[server]`: `llama_cpp.server.app` imports the server's own dependencies (uvicorn, fastapi, ...).
"$PY" -m pip uninstall --quiet --yes llama-cpp-python >/dev/null 2>&1 || true
"$PY" -m pip install --quiet --disable-pip-version-check "$WHEEL[server]" >&2
"$PY" -c "import llama_cpp.server.app" \
  || { echo "llama-cpp.sh: llama-cpp-python installed but its server does not import (message above)" >&2; exit 1; }
