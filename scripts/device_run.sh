#!/usr/bin/env bash
# The device run of issue 43: `make test-gpu` and `divjac bench --device` on the accelerators of
# this machine, divjac from source (PYTHONPATH=src, not installed), nothing from the internet.
#
#   OUT=/some/folder bash scripts/device_run.sh      # from the repository root
#
# What is missing (the CLI's typer, rich and matplotlib, pytest-timeout, the optional baselines
# folx, asdex, diffrax) is installed with --no-deps into /tmp/site from the local wheel index
# /opt/pypi/simple where it has them (DIVJAC_WHEELS to change it; nothing else is reached).
# DIVJAC_EXTRA_SITE: a folder of pure-Python packages carried along (folx, asdex, diffrax and its
# equinox, lineax, optimistix are not in the TPU image's index), put on PYTHONPATH after src.
# Each part runs under its own timeout and the next runs whatever the previous gave; one process
# holds the device at a time. Writes into $OUT: summary.txt (with the versions), tests.log, tests.xml
# (JUnit, with the planner's chunks as properties), cli.log, bench-<device>.log and
# bench-<device>/ (results.json, .md, .png, written after each module). Budget: under 9 minutes
# (TESTS_S + BENCH_S + set-up, about a minute).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-run}
PY=${PYTHON:-python3}
WHEELS=${DIVJAC_WHEELS:-/opt/pypi/simple}
SITE=${DIVJAC_SITE:-/tmp/site}
TESTS_S=${TESTS_S:-240}  # the default selection took 190 s on a TPU v5e (float64's compiles)
BENCH_S=${BENCH_S:-250}
QUICK=${BENCH_QUICK:---quick}
LOGS=${DIVJAC_LOGS:-/tmp/divjac-device-logs}  # the install log: at most 8 files come back
mkdir -p "$OUT" "$SITE" "$LOGS"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}:$SITE${DIVJAC_EXTRA_SITE:+:$DIVJAC_EXTRA_SITE}"
export PYTHONUNBUFFERED=1 JAX_TRACEBACK_FILTERING=off

say() { echo "== $*" | tee -a "$OUT/summary.txt"; }

# part NAME SECONDS COMMAND...: run under a timeout, log to $OUT/NAME.log, keep going.
part() {
    local name=$1 limit=$2 start rc
    shift 2
    say "$name (timeout ${limit} s): $*"
    start=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    say "$name: exit $rc after $(($(date +%s) - start)) s$([ $rc = 124 ] && echo ' (timed out)')"
    tail -n 25 "$OUT/$name.log"
}

# fill MODULE: install (no dependencies, into $SITE) each module that importing MODULE finds
# missing, until it imports or nothing more can be installed; says what is still missing.
fill() {
    local missing dist tries=0
    while [ $tries -lt 12 ]; do
        missing=$("$PY" -c "import $1" 2>&1 | sed -n "s/^ModuleNotFoundError: No module named '\([^'.]*\).*/\1/p")
        [ -z "$missing" ] && "$PY" -c "import $1" >>"$LOGS/install.log" 2>&1 && return 0
        [ -z "$missing" ] && break
        case $missing in
            PIL) dist=pillow ;; dateutil) dist=python-dateutil ;; fontTools) dist=fonttools ;;
            yaml) dist=pyyaml ;; *) dist=${missing//_/-} ;;
        esac
        echo "$1 needs $missing: installing $dist" >>"$LOGS/install.log"
        PIP_CONFIG_FILE=/dev/null timeout 60 "$PY" -m pip install -q --isolated --no-deps \
            --only-binary=:all: --index-url "file://$WHEELS" --target "$SITE" "$dist" \
            >>"$LOGS/install.log" 2>&1 || break
        tries=$((tries + 1))
    done
    say "cannot import $1 ($LOGS/install.log)"
    "$PY" -c "import $1" >>"$LOGS/install.log" 2>&1
}

say "divjac device run, $(date -u), $(git rev-parse --short HEAD 2>/dev/null)"
for module in typer rich matplotlib divjac.cli pytest_timeout folx asdex diffrax; do
    fill "$module"
done

"$PY" - >>"$OUT/summary.txt" 2>&1 <<'PYEOF'
import importlib.metadata as md, platform, sys
print("python", sys.version.replace("\n", " "), platform.machine())
for name in ("divjac", "jax", "jaxlib", "libtpu", "torch", "numpy", "scipy", "pytest",
             "hypothesis", "typer", "rich", "matplotlib", "folx", "asdex", "diffrax", "flax",
             "equinox"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "-")
try:
    import jax
    print("jax.devices()", jax.devices())
except Exception as err:
    print("jax:", type(err).__name__, err)
try:
    import torch
    print("torch.cuda", torch.cuda.is_available(), torch.version.cuda)
except Exception as err:
    print("torch:", type(err).__name__, err)
PYEOF
cat "$OUT/summary.txt"

# The devices: JAX's default backend (gpu or tpu), and cuda where torch sees it.
DEVICES=$("$PY" - 2>/dev/null <<'PYEOF'
found = []
try:
    import jax
    found += sorted({d.platform for d in jax.devices()} - {"cpu"})
except Exception:
    pass
try:
    import torch
    found += ["cuda"] if torch.cuda.is_available() else []
except Exception:
    pass
print(" ".join(found))
PYEOF
)
say "accelerators: ${DEVICES:-none}"

# make test-gpu, without make: the same pytest command (make may be absent on the device).
part tests "$TESTS_S" "$PY" -m pytest -m accelerator -p no:cacheprovider \
    -W ignore::pytest.PytestConfigWarning -rs -v --durations=15 -o junit_family=xunit1 \
    --junitxml="$OUT/tests.xml" \
    tests/accelerator
part cli 90 "$PY" -m pytest -p no:cacheprovider -W ignore::pytest.PytestConfigWarning -q \
    tests/cli/test_bench_device.py

for device in ${DEVICES:-}; do
    part "bench-$device" "$BENCH_S" "$PY" -m divjac bench --device "$device" $QUICK \
        --out "$OUT/bench-$device"
    [ -f "$OUT/bench-$device/results.md" ] && cat "$OUT/bench-$device/results.md"
done
say "done, $(date -u)"
