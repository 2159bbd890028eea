# Sourced by the scripts: make or reuse a virtual environment with pdserve installed.
# The venv sees the system's site-packages so an already-installed torch (a GPU box's own
# build) is kept; torch==2.13.0 (a CPU wheel here) is installed only when torch is missing.
pdserve_env() {
  local extras="${1:-}"
  local venv="${PDSERVE_VENV:-.venv}"
  local py="${PYTHON:-python3}"
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv --system-site-packages "$venv"
  fi
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  if ! python -c "import torch" 2>/dev/null; then
    echo "[pdserve] installing torch==2.13.0" >&2
    python -m pip install -q "torch==2.13.0"
  fi
  local stamp="$venv/.pdserve-installed-${extras:-base}"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "[pdserve] installing pdserve${extras:+[$extras]}" >&2
    python -m pip install -q -e ".${extras:+[$extras]}"
    touch "$stamp"
  fi
}
