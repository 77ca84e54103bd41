# Sourced by the side environments' scripts (sglang_env.sh, vllm_env.sh): one virtual environment
# under a stamp, with the CPU torch 2.13.0 held fixed by a pip constraint on every install.
#
#   side_env_begin VENV NAME MESSAGE FILE...   exit 0 (up to date) when VENV's stamp matches FILE...
#                                              and this file; else print MESSAGE, make VENV, install
#                                              pip and the CPU torch
#   pip_install ARGS...                        pip install into VENV under the torch constraint
#   side_env_done                              record the stamp (call last)

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

pip_install() { "$SIDE_VENV/bin/python" -m pip install -q -c "$SIDE_CONSTRAINTS" "$@"; }

side_env_done() { echo "$SIDE_WANT" > "$SIDE_STAMP"; }
