#!/usr/bin/env bash
# The project's test command. On Linux it installs a Vulkan driver when none
# is present (Mesa's lavapipe runs the kernels on the CPU) and g++ (the MSL
# kernels run on the CPU as C++, tests/msl_kernels.rs). On macOS it installs
# nothing: the adapter is Metal, and tests/metal_kernels.rs runs the kernel
# cases on it for the WGSL and the MSL pipelines and compiles every MSL
# variant with `xcrun -sdk macosx metal -Werror` (Xcode needed). Then format,
# lint, every test (ignored ones included), and a smoke run of the decode
# example.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = Darwin ]; then
    command -v g++ >/dev/null || { echo "g++ (Apple clang) is missing: xcode-select --install"; exit 1; }
    if ! xcrun -sdk macosx -f metal >/dev/null 2>&1; then
        echo "Apple's Metal compiler is missing: install Xcode (on Xcode 26 or later also" \
            "xcodebuild -downloadComponent MetalToolchain); tests/metal_kernels.rs needs it"
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
    trap 'rm -rf "$XDG_RUNTIME_DIR"' EXIT
fi

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --all-targets -- -D warnings
echo "== cargo test"
cargo test -- --include-ignored
echo "== decode example smoke test"
scripts/smoke_decode.sh
