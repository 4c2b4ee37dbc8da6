#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (fmt, clippy, cargo test, ruff, a bounded fuzz
# pass, pytest). Expects the package installed in the active
# Python environment (`pip install ".[test]"`).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --check
# `testing` (Cargo.toml) adds read fault injection (experts::fault) for the tests. The shipped
# library is linted without it as well, and so are the benches: `cargo bench` with no flag
# must build them (tests/test_foundation.py checks that no bench target requires a feature).
echo "== cargo clippy"
cargo clippy --all-targets --features testing -- -D warnings
cargo clippy --lib --benches -- -D warnings
echo "== ISA paths"
# Every kernel path this CPU has features for must run its tests, not skip them: the tests
# check the crate's detection against std's and fail when COLIBRI_REQUIRE_ISA names a feature
# or kernel that does not run (quant::kernels::isa_check). Computed from /proc/cpuinfo unless
# already set; left unset where there is none (macOS).
if [[ -z "${COLIBRI_REQUIRE_ISA+set}" && -r /proc/cpuinfo ]]; then
  flags=" $(grep -m1 -E '^(flags|Features)[[:space:]]*:' /proc/cpuinfo | cut -d: -f2) "
  require=()
  # /proc/cpuinfo's names, then std's where they differ.
  for f in avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni:avx512vnni asimd:neon; do
    if [[ "$flags" == *" ${f%%:*} "* ]]; then
      require+=("${f##*:}")
    fi
  done
  if ((${#require[@]})); then
    COLIBRI_REQUIRE_ISA=$(IFS=,; echo "${require[*]}")
    export COLIBRI_REQUIRE_ISA
  fi
fi
echo "COLIBRI_REQUIRE_ISA=${COLIBRI_REQUIRE_ISA-(unset)}"
grep -m1 -E '^(model name|flags|Features)' /proc/cpuinfo 2>/dev/null || sysctl -n machdep.cpu.brand_string 2>/dev/null || true
# Not `--lib`: that builds the library with other dependency features, a second time.
cargo test --features testing quant::kernels::isa_check::tests::report_the_isa_paths_this_host_runs \
  -- --exact --nocapture
echo "== cargo test"
cargo test --features testing
echo "== ruff"
ruff check python tests tools
ruff format --check python tests tools
echo "== fuzz (bounded pass, scripts/fuzz.sh)"
bash scripts/fuzz.sh
echo "== pytest"
set +e
python -m pytest "$@"
code=$?
set -e
# Exit code 5 means "no tests collected": not a failure of the code under test.
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests"
  code=0
fi
exit "$code"
