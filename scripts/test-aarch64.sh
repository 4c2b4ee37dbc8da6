#!/usr/bin/env bash
# Build and test the crate for aarch64 (the NEON kernels) on an x86-64 Linux host, running the
# test binaries under qemu user-mode emulation. Not part of CI: it needs the aarch64 standard
# library and an arm64 userland, which CI machines do not have.
#
# Prerequisites (once):
#   rustup target add aarch64-unknown-linux-gnu
#   dpkg --add-architecture arm64 && apt-get update
#   apt-get install gcc-aarch64-linux-gnu qemu-user libpython3.11:arm64
#
# Usage: scripts/test-aarch64.sh [cargo test arguments...], e.g. `scripts/test-aarch64.sh --lib`.
set -euo pipefail

target=aarch64-unknown-linux-gnu
libpython=$(ls /usr/lib/aarch64-linux-gnu/libpython3.*.so.1.0 2>/dev/null | head -n1 || true)
if [[ -z "$libpython" ]]; then
    echo "no arm64 libpython found: apt-get install libpython3.11:arm64 (after dpkg --add-architecture arm64)" >&2
    exit 1
fi
# The test binaries link libpython (through PyO3); give the linker a libpython3.X.so for the
# version PyO3 asks for when it has no interpreter to ask (the abi3 floor).
linkdir=$(mktemp -d)
trap 'rm -rf "$linkdir"' EXIT
for v in 3.10 3.11 3.12 3.13; do ln -s "$libpython" "$linkdir/libpython$v.so"; done

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-L $linkdir"
# `-L /`: load the arm64 multiarch loader and libc from /lib/aarch64-linux-gnu together. With
# `-L /usr/aarch64-linux-gnu` (the cross toolchain's older libc) the loader from one glibc and
# the libc from the other got mixed and every test hung in pthread_create.
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /"

cargo clippy --target "$target" --lib -- -D warnings
cargo test --release --target "$target" "$@"
