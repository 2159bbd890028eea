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
  # Found, not imported: importing torch costs about 2 CPU s, paid by every launch script.
  if ! python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)"; then
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
