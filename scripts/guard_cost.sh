#!/usr/bin/env bash
# The HTTP guard's cost on good requests: `python -m client bench` over HTTP
# against `launcher serve` with each guard of $GUARDS (default "python none"; also
# nginx), in turns, ROUNDS times.
#   [GUARDS="python nginx none"] [OPARA_GUARD_WORKERS=N] bash scripts/guard_cost.sh [MODEL] [ROUNDS] [SECONDS] [OUT_DIR]
# Writes OUT_DIR/<guard><round>.json (the bench rows: p50, throughput).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-deepfm} ROUNDS=${2:-2} SECONDS_PER_LEVEL=${3:-20} OUT=${4:-out/guard_cost}
PY=.venv/bin/python; [ -x "$PY" ] || PY=python3  # the GPU machine: its own python3 with .gpuenv on PYTHONPATH
REPO=$(mktemp -d)
trap 'rm -rf "$REPO"' EXIT
mkdir -p "$REPO/$MODEL/1" "$OUT"
cp "model_repository/$MODEL/config.pbtxt" "$REPO/$MODEL/"
cp "model_repository/$MODEL/1/model.py" "$REPO/$MODEL/1/"
PORT=$($PY -c 'from opara_core.serving.launcher import free_port; print(free_port())')
export HTTP_PORT=$PORT GRPC_PORT=$($PY -c 'from opara_core.serving.launcher import free_port; print(free_port())')
export METRICS_PORT=$($PY -c 'from opara_core.serving.launcher import free_port; print(free_port())')
for round in $(seq "$ROUNDS"); do
  for mode in ${GUARDS:-python none}; do
    $PY -m opara_core.serving.launcher serve --model-repository "$REPO" --guard "$mode" > "$OUT/$mode$round.log" 2>&1 &
    server=$!
    until $PY -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" \
        "http://127.0.0.1:$PORT/v2/models/$MODEL/ready" 2>/dev/null; do sleep 1; done
    $PY -m client bench --model "$MODEL" --protocol http --url "127.0.0.1:$PORT" --concurrency 1,16 \
        --duration "$SECONDS_PER_LEVEL" --warmup 20 --no-progress --json "$OUT/$mode$round.json"
    kill -TERM "$server"; wait "$server" || true
  done
done
