#!/usr/bin/env bash
# The project's test command: installs a Vulkan driver when none is present
# (Mesa's lavapipe runs the kernels on the CPU) and g++ (the MSL kernels run
# on the CPU as C++, tests/msl_kernels.rs), then format, lint, every test
# (ignored ones included), and a smoke run of the decode example.
set -euo pipefail
cd "$(dirname "$0")/.."

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
