#!/usr/bin/env bash
# A bounded fuzz pass (CI runs it from scripts/test.sh; docs/reliability.md):
#  1. each cargo-fuzz target (fuzz/) for FUZZ_SECONDS (default 20) from a scratch copy of its
#     committed seed corpus (fuzz/corpus/<target>), so CI never grows the corpus;
#  2. the Python mutation fuzzer over whole model directories for PY_FUZZ_SECONDS (default 40).
# About 100 s of fuzzing in all, plus building the targets (incremental after the first).
# The cargo-fuzz part needs a nightly toolchain and cargo-fuzz; without them it is skipped
# with the reason printed, and the Python part still runs. Any crash, hang, leak past the
# RSS limit or untyped error fails the script and leaves the reproducer in fuzz/artifacts/.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${FUZZ_SECONDS:-20}"
targets=(safetensors_header config container_index)

if ! cargo +nightly --version >/dev/null 2>&1; then
  echo "fuzz: no nightly toolchain (rustup toolchain install nightly): skipping the cargo-fuzz targets"
elif ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "fuzz: cargo-fuzz is not installed (cargo install cargo-fuzz): skipping the cargo-fuzz targets"
else
  cargo +nightly fuzz build -O >/dev/null
  for t in "${targets[@]}"; do
    work="$(mktemp -d)"
    cp "fuzz/corpus/$t/"* "$work/"
    log="$work.log"
    if ! cargo +nightly fuzz run -O "$t" "$work" -- -max_total_time="$secs" \
        -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 >"$log" 2>&1; then
      tail -n 60 "$log"
      echo "fuzz: target $t FAILED (reproducer in fuzz/artifacts/$t/)"
      exit 1
    fi
    runs="$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' || true)"
    cov="$(grep -Eo 'cov: [0-9]+' "$log" | tail -n 1 || true)"
    echo "fuzz: $t: ${runs:-?} executions in ${secs} s, ${cov:-cov: ?}, no crash"
    rm -rf "$work" "$log"
  done
fi

python tools/fuzz_containers.py --seconds "${PY_FUZZ_SECONDS:-40}" --workers 2
