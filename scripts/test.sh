#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (fmt, clippy, cargo test, ruff, a bounded fuzz
# pass, pytest). Expects the package installed in the active
# Python environment (`pip install ".[test]"`).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --check
# `testing` (Cargo.toml) adds the test fixtures (experts::synth, experts::fault) the bench and
# the make_synthetic example use; the shipped library is linted without it as well.
echo "== cargo clippy"
cargo clippy --all-targets --features testing -- -D warnings
cargo clippy --lib -- -D warnings
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
