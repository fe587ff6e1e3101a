#!/usr/bin/env bash
# The decode example's contract: --json prints the result object as the last
# line (its "kernels": "msl" or "wgsl", and the start-up "self_check"); without --backend portable a non-Metal machine exits 2 with
# non_metal_adapter; a missing checkpoint exits 2 with checkpoint_not_found; a
# malformed argument exits 2 with invalid_argument (tests/it/cli.rs has the full set).
set -euo pipefail
# The engine's variables apply where a flag is absent: start from none.
unset QWEN3_WGPU_BACKEND QWEN3_WGPU_KERNELS QWEN3_WGPU_MATVEC_LAYOUT
cd "$(dirname "$0")/.."
ckpt=tests/fixtures/mlx/gqa2_hd64
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
# Run from scripts/test.sh (QWEN3_WGPU_TEST_FEATURES set), its `cargo test`
# built the example already (the test profile, its features). Run alone, the
# same build: a build of the example alone would resolve the dependencies'
# features differently and build them all again.
if [ -z "${QWEN3_WGPU_TEST_FEATURES:-}" ]; then
    cargo test -q --workspace --no-run
fi
bin=${CARGO_TARGET_DIR:-target}/debug/examples/decode

check_json() { # $1: stdout's last line, $2: python assertion on `d`
    python3 -c "import json,sys; d=json.loads(sys.argv[1]); $2" "$1"
}

# The portable policy takes the Metal adapter on macOS, where the MSL twins run.
kernels=wgsl
[ "$(uname -s)" != Darwin ] || kernels=msl
last=$($bin --checkpoint $ckpt --prompt-ids 1,2,3 --max-new-tokens 5 --backend portable --cache-dir "$cache" --json | tail -n 1)
echo "portable: $last"
check_json "$last" 'assert d["n_prompt"]==3 and d["token_ids"][:3]==[1,2,3] and len(d["generated_ids"])>=1 and d["converted"] is True and d["adapter"]["backend"] and d["stop_reason"] in ("max_new_tokens","end_of_text") and d["decode_tokens_per_sec"]>=0 and "prefill_ms" in d and "load_ms" in d and d["kernels"]=="'$kernels'" and d["self_check"]["ok"] is True and d["self_check"]["pipelines"]==22 and d["self_check"]["ms"]>0 and "kernels_fallback" not in d'
last2=$($bin --checkpoint $ckpt --prompt-ids 1,2,3 --max-new-tokens 5 --backend portable --cache-dir "$cache" --json | tail -n 1)
check_json "$last2" 'assert d["converted"] is False'
python3 -c "import json,sys; a=json.loads(sys.argv[1]); b=json.loads(sys.argv[2]); assert a['token_ids']==b['token_ids']" "$last" "$last2"
# Forcing WGSL (flag and environment) gives the same tokens; off Metal it is WGSL anyway.
last3=$(QWEN3_WGPU_KERNELS=wgsl $bin --checkpoint $ckpt --prompt-ids 1,2,3 --max-new-tokens 5 --backend portable --kernels wgsl --cache-dir "$cache" --json | tail -n 1)
python3 -c "import json,sys; a=json.loads(sys.argv[1]); b=json.loads(sys.argv[2]); assert a['token_ids']==b['token_ids'] and b['kernels']=='wgsl'" "$last" "$last3"

expect_error() { # $1: code, rest: args
    local code=$1 out rc
    shift
    set +e
    out=$($bin "$@" --json 2>/dev/null)
    rc=$?
    set -e
    [ "$rc" -eq 2 ] || { echo "$code: expected exit status 2, got $rc"; exit 1; }
    out=$(printf '%s\n' "$out" | tail -n 1)
    echo "$code: $out"
    check_json "$out" "assert d['error']['code']=='$code', d"
}
if [ "$(uname -s)" != Darwin ]; then
    expect_error non_metal_adapter --checkpoint $ckpt --prompt-ids 1,2,3
fi
expect_error checkpoint_not_found --checkpoint /nonexistent/ckpt --prompt-ids 1 --backend portable
expect_error invalid_argument --checkpoint $ckpt --prompt-ids 1,,2 --backend portable
expect_error invalid_token_id --checkpoint $ckpt --prompt-ids 1,99999 --backend portable --no-cache
echo "decode example: OK"
