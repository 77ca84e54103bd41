# Sourced by the environments' scripts (bootstrap.sh, sglang_env.sh, vllm_env.sh).
#
#   quiet_pip PYTHON ARGS...                   pip install -q, its expected noise filtered (below)
#   side_env_begin VENV NAME MESSAGE FILE...   exit 0 (up to date) when VENV's stamp matches FILE...
#                                              and this file; else print MESSAGE, make VENV, install
#                                              pip and the CPU torch
#   pip_install ARGS...                        quiet_pip into VENV under the torch constraint
#   side_env_done                              record the stamp (call last)
#
# The noise: where pip's configuration names a local index folder that lacks a package (as on
# these machines), pip warns "Location '...' is ignored" once per package and goes on to the
# next index; nothing is wrong, so those lines are dropped. Everything else pip says is kept.

quiet_pip() {
  local python="$1"
  shift
  set +e
  PYTHONWARNINGS="ignore::UserWarning" "$python" -m pip install -q "$@" 2>&1 | grep -vE "^WARNING: Location '[^']*' is ignored"
  local status="${PIPESTATUS[0]}"
  set -e
  return "$status"
}

side_env_begin() {
  SIDE_VENV="$1"
  local name="$2" message="$3"
  shift 3
  SIDE_STAMP="$SIDE_VENV/.kamera-$name"
  SIDE_WANT="$(cat "$@" scripts/side_env.sh | sha256sum | cut -d' ' -f1)"
  if [ -f "$SIDE_STAMP" ] && [ "$(cat "$SIDE_STAMP")" = "$SIDE_WANT" ]; then
    exit 0
  fi
  echo "$message"
  [ -x "$SIDE_VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$SIDE_VENV"
  SIDE_CONSTRAINTS="$(mktemp)"
  trap 'rm -f "$SIDE_CONSTRAINTS"' EXIT
  echo "torch==2.13.0" > "$SIDE_CONSTRAINTS"
  pip_install --upgrade pip
  pip_install "torch==2.13.0"
}

# --no-warn-conflicts: a side environment installs its engine without the dependencies it never
# uses on CPU (CUDA kernels, torch add-ons), so pip's "requires X, which is not installed" list is
# the plan, not a fault; the scripts import what they need at the end instead.
pip_install() { quiet_pip "$SIDE_VENV/bin/python" --no-warn-conflicts -c "$SIDE_CONSTRAINTS" "$@"; }

side_env_done() { echo "$SIDE_WANT" > "$SIDE_STAMP"; }
