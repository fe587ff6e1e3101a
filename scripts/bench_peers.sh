#!/usr/bin/env bash
# Side-by-side decode benchmark in one run: this engine (portable policy,
# Vulkan) and Hugging Face transformers on the same architecture (random
# weights, bf16), on the same GPU. Expects release binaries of the `bench`
# and `random_checkpoint` examples in $BIN (default target/release/examples)
# and hf_peers.py in $PEERS (default ../shared/bench/hf_peers.py).
# Writes JSON lines to stdout; progress to stderr.
#
#   cargo build --release --examples && scripts/bench_peers.sh
set -euo pipefail
BIN=${BIN:-target/release/examples}
PEERS=${PEERS:-../shared/bench/hf_peers.py}
MODES=${MODES:-loop static_auto}
CONTEXTS=${CONTEXTS:-128,1024,4000}
TOKENS=${TOKENS:-128}
ckpt=$(mktemp -d)
trap 'rm -rf "$ckpt"' EXIT
date -u +'{"date": "%Y-%m-%dT%H:%M:%SZ"}'
"$BIN/random_checkpoint" "$ckpt" >&2
"$BIN/bench" --checkpoint "$ckpt" --backend portable --contexts "$CONTEXTS" --tokens "$TOKENS" --lookaheads "${LOOKAHEADS:-1,4}"
if python3 -c 'import torch, transformers' 2>/dev/null; then
    for mode in $MODES; do
        out=$(mktemp)
        PYTHONUNBUFFERED=1 python3 "$PEERS" --mode "$mode" --new "$TOKENS" --json "$out" >&2 || true
        python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({"bench": "hf_transformers", "mode": d.get("mode"), "decode_tokens_per_sec": d.get("decode_tps_median"), "new": d.get("new"), "prompt": d.get("prompt")}))' "$out" || true
    done
else
    echo "torch/transformers not installed: peer skipped" >&2
fi
