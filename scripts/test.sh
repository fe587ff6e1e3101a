#!/usr/bin/env bash
# The project's test command. On Linux it installs a Vulkan driver when none
# is present (Mesa's lavapipe runs the kernels on the CPU) and g++ (the MSL
# kernels run on the CPU as C++, tests/it/msl_kernels.rs). On macOS it installs
# nothing: the adapter is Metal, and tests/it/metal_kernels.rs runs the kernel
# cases on it for the WGSL and the MSL pipelines and compiles every MSL
# variant with `xcrun -sdk macosx metal -Werror` (Xcode needed). Then format,
# lint (with and without the `hub` feature), every test of the workspace
# (the `hub` feature on, ignored ones included; the C ABI's in
# capi/ compile the C and C++ examples with cc/c++ under AddressSanitizer),
# the package's size, and a smoke run of the decode example.
set -euo pipefail
cd "$(dirname "$0")/.."

private_runtime_dir=""
# Each phase's wall time, printed at the end (also when a phase fails), so
# every log shows where the time went.
phase_names=()
phase_seconds=()
current_phase=""
current_start=0
script_start=$SECONDS
phase() {
    finish_phase
    current_phase=$1
    current_start=$SECONDS
    echo "== $1"
}
finish_phase() {
    if [ -n "$current_phase" ]; then
        phase_names+=("$current_phase")
        phase_seconds+=($((SECONDS - current_start)))
        current_phase=""
    fi
}
on_exit() {
    local status=$?
    local failed=$current_phase
    finish_phase
    echo "== time per phase"
    for i in "${!phase_names[@]}"; do
        printf '%5d s  %s%s\n' "${phase_seconds[$i]}" "${phase_names[$i]}" \
            "$([ "${phase_names[$i]}" = "$failed" ] && [ "$status" -ne 0 ] && echo "  (failed)")"
    done
    printf '%5d s  in all\n' $((SECONDS - script_start))
    [ -z "$private_runtime_dir" ] || rm -rf "$private_runtime_dir"
}
trap on_exit EXIT

phase "installs (a Vulkan driver and g++ where missing)"

if [ "$(uname -s)" = Darwin ]; then
    command -v g++ >/dev/null || { echo "g++ (Apple clang) is missing: xcode-select --install"; exit 1; }
    if ! xcrun -sdk macosx -f metal >/dev/null 2>&1; then
        echo "Apple's Metal compiler is missing: install Xcode (on Xcode 26 or later also" \
            "xcodebuild -downloadComponent MetalToolchain); tests/it/metal_kernels.rs needs it"
        exit 1
    fi
else
    have_vulkan_driver() {
        ls /usr/share/vulkan/icd.d/*.json >/dev/null 2>&1 || ls /etc/vulkan/icd.d/*.json >/dev/null 2>&1
    }
    # (grep without -q: with pipefail, an early exit would fail the pipeline)
    if ! have_vulkan_driver || ! ldconfig -p | grep libvulkan.so.1 >/dev/null; then
        echo "== installing Mesa's Vulkan driver (lavapipe)"
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
    fi
    if ! command -v g++ >/dev/null; then
        echo "== installing g++ (for the MSL kernel tests)"
        SUDO=""
        [ "$(id -u)" -eq 0 ] || SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++ >/dev/null
    fi
fi

# Mesa's Vulkan loader warns on stderr for every device when XDG_RUNTIME_DIR
# is unset or missing (as in containers and CI); give the run a private one.
if [ -z "${XDG_RUNTIME_DIR:-}" ] || [ ! -d "$XDG_RUNTIME_DIR" ]; then
    XDG_RUNTIME_DIR=$(mktemp -d)
    export XDG_RUNTIME_DIR
    private_runtime_dir=$XDG_RUNTIME_DIR
fi


# A build from scratch (a fresh clone, as in CI) gains nothing from
# incremental compilation's caches, only their cost: off unless the
# caller chose, or a target directory is there to reuse.
if [ -z "${CARGO_INCREMENTAL:-}" ] && [ ! -d "${CARGO_TARGET_DIR:-target}" ]; then
    export CARGO_INCREMENTAL=0
    echo "== no target directory yet: CARGO_INCREMENTAL=0"
fi

phase "cargo fmt --check"
cargo fmt --all -- --check
# Every build below has the same features, the optional `hub` one on
# (its tests, tests/it/hub.rs and decode --model, need it): one feature
# resolution, so the dependencies build once. The examples tests/it/cli.rs
# and the smoke test build get the same features.
export QWEN3_WGPU_TEST_FEATURES=hub
features=(--features "qwen3-wgpu/$QWEN3_WGPU_TEST_FEATURES")
phase "cargo clippy"
cargo clippy --workspace --all-targets "${features[@]}" -- -D warnings
# The API reference and the guide (src/guide/): a broken intra-doc link fails.
# With the examples, the build takes the dev-dependencies' features too, as
# clippy's did: the same dependency builds, none a second time.
phase "cargo doc"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --lib --examples "${features[@]}"
phase "cargo check (default features: the library and the examples build without hub)"
cargo check --workspace --lib --examples
phase "cargo test --no-run (one test binary per package, the examples)"
cargo test --workspace "${features[@]}" --no-run
phase "cargo test (the crate and the C ABI, capi/)"
cargo test --workspace "${features[@]}" -- --include-ignored
phase "cargo package (size)"
# The published crate leaves the test fixtures out; keep it well under
# crates.io's 10 MB limit.
cargo package --allow-dirty --no-verify --quiet
target_dir=$(cargo metadata --no-deps --format-version 1 | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
crate_file="$target_dir/package/qwen3-wgpu-$version.crate"
crate_bytes=$(wc -c <"$crate_file")
max_bytes=$((2 * 1024 * 1024))
echo "$crate_file: $crate_bytes bytes (at most $max_bytes)"
if [ "$crate_bytes" -gt "$max_bytes" ]; then
    echo "the package is larger than $max_bytes bytes: exclude dev-only files in Cargo.toml (cargo package --list)"
    exit 1
fi
phase "decode example smoke test"
scripts/smoke_decode.sh
