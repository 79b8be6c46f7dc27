#!/bin/bash
# The GPU checks the open issues still need, as named steps that fit the GPU
# machine's 10-minute calls: `bash scripts/gpu_checks.sh STEP[:SECONDS] [...]`
# (SECONDS: the step's time limit, default 560; e.g. `csan:150 racecheck:420`).
#
#   tests      every test marked gpu (engine, fallback metric)
#   servertests tests/test_models.py and tests/test_faults.py with the server on the GPU (every
#              model over HTTP and gRPC against the eager oracle, faults); ~400 s on an H100
#   launcher   the launcher on a GPU host: GPU metrics on (nv_gpu_* on /metrics), the device-node
#              detection agrees with torch, explicit model control with a GPU DeepFM (unload, load, a killed stub)
#   csan       every model's eager multi-stream schedule under PyTorch's CUDA sanitizer
#   racecheck  GoogLeNet's graphs under compute-sanitizer --tool racecheck (no autotuning)
#   serving    scripts/serving_bench.py for the models in $MODELS (default nasnet,deepfm)
#   soak       GoogLeNet served by `python -m opara_core.serving.launcher serve` on ports 18000-18002,
#              scripts/soak.py over gRPC at 1, 8 and 64 ($SOAK_SECONDS each, default 30, and as long a warm-up): errors, wrong
#              answers, host and GPU memory growth
#
# Each step is time-limited, logs to $OUT/<step>.log (OUT defaults to ./out) and
# appends "step rc seconds" to $OUT/steps.txt, so a step that runs out of time
# still leaves its log. The serving stack must be importable: the nvidia-pytriton
# wheel (tritonserver 2.51) and tritonclient on PYTHONPATH, perf_analyzer 2.60 in
# $PERF_ANALYZER, and OPARA_ADMIN_KEY set: on the GPU machine, carry .gpuenv
# (scripts/make_gpuenv.sh makes it here) and `source .gpuenv/setup_env.sh` first.
set -u
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD

step() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "$name rc=$? $((SECONDS - start))s" | tee -a "$out/steps.txt"
}

soak() {
    local repository
    repository=$(mktemp -d)
    cp -r model_repository/googlenet "$repository/"
    HTTP_PORT=18000 GRPC_PORT=18001 METRICS_PORT=18002 python3 -m opara_core.serving.launcher serve --model-repository "$repository" \
        >"$out/soak_server.log" 2>&1 &
    local server=$!
    python3 -c "
import time, urllib.request
for _ in range(150):
    try:
        urllib.request.urlopen('http://127.0.0.1:18000/v2/health/ready', timeout=2); break
    except Exception:
        time.sleep(2)
else:
    raise SystemExit('server not ready after 300 s')
" && python3 scripts/soak.py --url 127.0.0.1:18001 --protocol grpc --model googlenet --duration "${SOAK_SECONDS:-30}" \
        --concurrency 1,8,64 --warmup "${SOAK_SECONDS:-30}" --json "$out/soak.json"
    local rc=$?
    kill -TERM $server
    wait $server
    return $rc
}

export -f soak
export out

for spec in "$@"; do
    name=${spec%%:*}
    limit=560
    [[ $spec == *:* ]] && limit=${spec#*:}
    case $name in
    tests) step tests "$limit" python3 -m pytest -p no:cacheprovider -m gpu -q --durations=10 tests ;;
    servertests) step servertests "$limit" python3 -m pytest -p no:cacheprovider -m "gpu or server" -q -rfE --durations=10 \
        tests/test_models.py tests/test_faults.py ;;
    launcher) step launcher "$limit" python3 -m pytest -p no:cacheprovider -q -rfE --durations=5 tests/test_launcher.py \
        tests/test_startup.py -k "gpu_metrics or gpu_detection or explicit_model_control or ready_line" ;;
    csan) step csan "$limit" python3 scripts/race_check.py eager --sanitizer --runs 2 --json "$out/race_eager.json" ;;
    racecheck) step racecheck "$limit" compute-sanitizer --tool racecheck --print-limit 20 \
        python3 scripts/race_check.py graph --model googlenet --replays 2 --autotune off --json "$out/racecheck.json" ;;
    serving) step serving "$limit" python3 scripts/serving_bench.py --models "${MODELS:-nasnet,deepfm}" --concurrency 1,16 \
        --shared-memory none,system --requests 200 --perf-analyzer "${PERF_ANALYZER:-perf_analyzer}" \
        --json "$out/serving.json" --log "$out/server.log" ;;
    soak) step soak "$limit" bash -c soak ;;
    *) echo "unknown step $name (tests, servertests, launcher, csan, racecheck, serving, soak)" >&2; exit 2 ;;
    esac
done
