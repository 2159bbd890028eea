#!/usr/bin/env bash
# Mutation testing of the core modules with mutmut (docs/testing.md): each module's mutants run
# against its focused unit tests, in a scratch copy of this checkout (never in the checkout
# itself), and each module's score is printed: killed / (total - equivalent).
#
#   scripts/mutation.sh                  every module of scripts/mutation.toml (about 30 min)
#   scripts/mutation.sh sampler usage    only these
#   scripts/mutation.sh --score sampler  score the last run's copy again (after editing the
#                                        [equivalent] list), without running mutmut
#
# MUTATION_DIR (default /tmp/pdserve-mutation) holds one fresh copy per module, kept after the
# run so that `cd $MUTATION_DIR/MODULE && mutmut show NAME` prints a mutant's diff.
# MUTATION_MIN (default 90): exit 1 when a module scores below it.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=${MUTATION_DIR:-/tmp/pdserve-mutation}
export MUTATION_CONFIG=$repo/scripts/mutation.toml MUTATION_MIN=${MUTATION_MIN:-90}

if "${PDSERVE_VENV:-.venv}/bin/python" -c "import mutmut" 2>/dev/null; then
  # shellcheck disable=SC1091
  source "${PDSERVE_VENV:-.venv}/bin/activate"
else
  source scripts/_env.sh
  pdserve_env mutation
fi
# Two test processes share the cores; torch's own threads would only fight them.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

# The helper: reads the config, lays out a copy, writes mutmut's config, scores a run.
read -r -d '' helper <<'PY' || true
import fnmatch, glob, json, os, shutil, sys
from pathlib import Path

try:
    from tomllib import loads
except ModuleNotFoundError:  # Python 3.10: mutmut depends on the toml package there
    from toml import loads

config = loads(Path(os.environ["MUTATION_CONFIG"]).read_text())
modules, equivalent = config["modules"], config.get("equivalent", {})


def package_path(source: str, pyproject: Path) -> str:
    """Where `source` lands in the installed layout (pdserve/common/..., as imported)."""
    dirs = loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    top, _, rest = source.partition("/")
    hits = [pkg for pkg, folder in dirs.items() if folder == top]
    return "/".join(hits[0].split(".")) + "/" + rest if hits else source


def layout(copy: Path) -> None:
    """Moves each folder that pyproject maps into the package (common -> pdserve/common), so
    the copy imports as installed: with the copy first on sys.path, no module resolves to the
    checkout that the venv's editable install points at."""
    dirs = loads((copy / "pyproject.toml").read_text())["tool"]["setuptools"]
    for pkg, folder in dirs["package-dir"].items():
        if pkg != folder:
            shutil.move(copy / folder, copy / pkg.replace(".", "/"))


def setup(copy: Path, name: str) -> None:
    """mutmut's config for one module: the whole package is copied, one file mutated."""
    mod = modules[name]
    tests = [t for pat in mod["tests"] for t in sorted(glob.glob(pat, root_dir=copy))]
    assert tests, f"{name}: no test file matches {mod['tests']}"
    path = package_path(mod["source"], copy / "pyproject.toml")
    args = ["-p no:cacheprovider", *(f"--deselect={t}" for t in mod.get("deselect", []))]
    (copy / "setup.cfg").write_text(
        "[mutmut]\nsource_paths = pdserve\n"
        f"only_mutate = {path}\n"
        "pytest_add_cli_args_test_selection =\n" + "".join(f"    {t}\n" for t in tests)
        + "pytest_add_cli_args =\n" + "".join(f"    {a}\n" for a in args)
    )
    print(" ".join(mod.get("functions", [])))


def score(copy: Path, name: str) -> None:
    """One line per module, then the mutants that survived and are not known equivalent."""
    from mutmut.stats import status_by_exit_code

    mod = modules[name]
    meta = copy / "mutants" / (package_path(mod["source"], copy / "pyproject.toml") + ".meta")
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    globs = mod.get("functions", ["*"])
    status = {
        k: status_by_exit_code[v]
        for k, v in codes.items()
        if any(fnmatch.fnmatchcase(k, g) for g in globs)
    }
    caught = {"killed", "timeout", "caught by type check", "segfault"}
    killed = sum(s in caught for s in status.values())
    equiv = [k for k in status if k in equivalent]
    stale = [k for k in equiv if status[k] in caught]
    alive = sorted(k for k, s in status.items() if s not in caught and k not in equivalent)
    counted = len(status) - len(equiv) + len(stale)
    pct = 100.0 * killed / counted if counted else 100.0
    print(f"{name:18} {killed:4} / ({len(status):4} - {len(equiv) - len(stale):3}) = {pct:5.1f}%")
    for k in alive:
        print(f"    {status[k]:10} {k}")
    for k in stale:
        print(f"    listed as equivalent but killed (remove it from the list): {k}")
    sys.exit(0 if pct >= float(os.environ["MUTATION_MIN"]) else 3)


cmd, arg = sys.argv[1], sys.argv[2:]
if cmd == "modules":
    print(" ".join(modules))
elif cmd == "layout":
    layout(Path(arg[0]))
elif cmd == "setup":
    setup(Path(arg[0]), arg[1])
elif cmd == "score":
    score(Path(arg[0]), arg[1])
PY

rescore=0
if [ "${1:-}" = "--score" ]; then
  rescore=1
  shift
fi
wanted=("$@")
if [ ${#wanted[@]} -eq 0 ]; then
  read -r -a wanted <<<"$(python -c "$helper" modules)"
fi

# A fresh copy of this checkout's files as they are now (tracked and untracked, not ignored).
fresh_copy() {
  rm -rf "$1" && mkdir -p "$1"
  git -C "$repo" ls-files -z --cached --others --exclude-standard \
    | (cd "$repo" && tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$1"
  python -c "$helper" layout "$1"
}

status=0
report=()
for name in "${wanted[@]}"; do
  copy=$work/$name
  echo "== $name ($(date +%H:%M:%S))"
  if [ "$rescore" = 0 ]; then
    fresh_copy "$copy"
    read -r -a names <<<"$(cd "$copy" && python -c "$helper" setup "$copy" "$name")"
  fi
  if [ "$rescore" = 0 ] \
    && ! (cd "$copy" && nice -n 10 mutmut run --max-children 2 "${names[@]}" >mutmut.log 2>&1); then
    tail -n 30 "$copy/mutmut.log"
    report+=("$name: mutmut failed, see $copy/mutmut.log")
    status=1
    continue
  fi
  line=$(cd "$copy" && python -c "$helper" score "$copy" "$name") || status=1
  echo "$line"
  report+=("$(head -n 1 <<<"$line")")
done

echo
echo "== mutation score, killed / (total - equivalent), $(date +%F), $(git -C "$repo" rev-parse --short HEAD)"
printf '%s\n' "${report[@]}"
exit "$status"
