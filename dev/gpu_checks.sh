#!/bin/bash
# The GPU checks the open issues still need, as named steps that fit the GPU
# machine's 10-minute calls: `bash dev/gpu_checks.sh STEP[:SECONDS] [...]`
# (SECONDS: the step's time limit, default 560; e.g. `csan:150 racecheck:420`).
#
#   tests      every test marked gpu (engine, fallback metric; 89 tests, the first 12 took 175 s on an
#              H200); $TESTS narrows it (pytest arguments, e.g. "tests/test_capture.py tests/test_runtime.py"
#              on one GPU, the rest on another); test_deploy.py and test_dockerfile.py are left out: they
#              hold no GPU test and import CI-only packages the GPU machine lacks
#   gputests   every test marked gpu in five shards side by side on the one GPU (capture; fused lanes; builds,
#              choices, profiles, segments, Inductor's cache; the server's and varlen's; every other file),
#              each its own OPARA_CACHE_DIR (2026-12-06, H200: four such shards finished three in 370-490 s; the
#              fourth, fused lanes with the builds, needed a call of its own, hence five; `tests` needs several); $out/gputests_<shard>.log (-v, tracebacks) and .xml (JUnit); a shard that
#              reaches the limit is stopped with SIGINT, so its log still ends with the summary
#   servertests tests/test_models.py and tests/test_faults.py with the server on the GPU (every
#              model over HTTP and gRPC against the eager oracle, faults); ~400 s on an H100
#   launcher   the launcher on a GPU host: GPU metrics on (nv_gpu_* on /metrics), the device-node
#              detection agrees with torch, explicit model control with a GPU DeepFM (unload, load, a killed stub)
#   csan       every model's eager multi-stream schedule under PyTorch's CUDA sanitizer
#   racecheck  GoogLeNet's graphs under compute-sanitizer --tool racecheck (no autotuning)
#   transporttests the GPU path's tests: CUDA shared memory through the client against googlenet and
#              deepfm on the GPU (tests/test_client.py -m gpu), the batch id check's one synchronisation
#              (tests/test_triton_backend.py -m gpu), and the numpy-2 stub test (uses the machine's numpy 2)
#   transport  scripts/serving_bench.py for GoogLeNet alone: batch 1 over gRPC at concurrency 1 and 16,
#              tensors in the message, system and CUDA shared memory, each level beside the no-op floor
#              model; $OUT/transport.json, $OUT/transport_server.log
#   transportexp the #15 experiment, one setting changed at a time, each its own server (GoogLeNet, batch 1,
#              gRPC, every row beside the floor), in this order: t1 (torch_threads=1, the default on a GPU
#              instance) in none/system/cuda at concurrency 1 and 16; t0 (torch's default threads, the old
#              behaviour) in none at 1 and 16; t1_host (output_memory=host) in cuda at 1 and 16; t1_cpuonly
#              (FORCE_CPU_ONLY_INPUT_TENSORS=yes) in none and cuda at 1 and 16; t1_host_x2 (2 instances) in
#              none and cuda at 16; t1_host_greedy0 (no preferred batch sizes, no queue delay: a lone request
#              goes at once, a busy instance still finds a batch) in cuda at 1 and 16;
#              $OUT/exp_<name>.json and exp_<name>_server.log; a server starts only with 100 s left
#   serving    the same for the models in $MODELS (default resnet50,inception_v3,deepfm,bert,t5);
#              $OUT/serving.json, $OUT/server.log
#              (both benchmark steps start no level later than 45 s before their limit, $BUDGET to change)
#   instances  GoogLeNet at concurrency 16 with 1, 2 and 4 instances per GPU ($INSTANCES), batching
#              $BATCHING (preferred or greedy), queue delay $QUEUE_DELAY us (default: the config's),
#              tensors in the message and CUDA shared memory; $OUT/instances_<n>.json, each its own server
#   twogpu     GoogLeNet at concurrency 16, 32 and 64 on one GPU (CUDA_VISIBLE_DEVICES=0) and then on
#              every GPU of the machine, $TWOGPU_INSTANCES instances per GPU (default 1), shared memory
#              $TWOGPU_SHM (default none,system): $OUT/twogpu_one.json, $OUT/twogpu_all.json
#   varlen     scripts/varlen_bench.py: BERT ($VARLEN_MODELS, default bert) with seeded lengths (mean 50, cap 512)
#              at concurrency 1, 16, 64 against its no-op floor and under the padded, single, greedy and dp
#              schedulers, with where each level's execute time went; $OUT/varlen_bench.json (written after
#              every row), $OUT/varlen_server.log; $VARLEN_ARGS adds arguments (e.g. "--instances 2",
#              "--set bert:compiler=engine")
#   varlentests the variable-length GPU tests: two BERT shapes in one graph pool replayed in turns, and
#              every scheduler on a few shapes' graphs, each against eager (tests/test_capture.py, tests/test_varlen.py);
#              BERT's and T5's whole-model Inductor compiles make it longer than 210 s cold (H100, 2026-11-26: 302 s,
#              with the cases of the since removed compilers inductor and aot)
#   warmbuild  a serving build cold then warm: a repository of $WARM_MODELS (default googlenet) with the
#              parameters $WARM_PARAMS (KEY=VALUE ..., default fused_lanes=true, empty for none; e.g. WARM_MODELS="bert t5"
#              WARM_PARAMS=compiler=engine), `python -m opara_core.serving.launcher warm` twice with one fresh
#              OPARA_CACHE_DIR (Inductor's compiled code, saved whole-model artifacts, profiles, traces, seeded weights):
#              each model's build seconds both times; `warm` builds every shape of a variable-length model
#              unless OPARA_CAPTURE is set (OPARA_CAPTURE=first_use times a first-use start);
#              $WARM_CACHE: that cache directory instead of a fresh one, $WARM_RUNS: the runs (default
#              "cold warm"): a cold build longer than one call (NASNet) goes on in the next call on the
#              same machine with WARM_CACHE=$PWD/.benchcache/x WARM_RUNS="cold warm" (saved segments are kept)
#   fusedtests the GPU tests of fused lanes, remembered choices, builds, captures and profiles
#              (tests/test_fused_lanes.py, test_choices.py, test_build.py, test_capture.py, test_profile.py)
#   bench      python -m opara_core.bench for $BENCH_MODELS (default googlenet,bert) at $BENCH_BATCH
#              (default 1,8,32): every column incl. torch.compile with freezing and fused lanes, the
#              serving build cold and warm; $OUT/bench.json (rows saved after each model), $OUT/bench.log
#   (several bench runs at once, one per GPU, over several calls: dev/gpu_queue.py)
#   generation scripts/generation_bench.py at the model's defaults, 64 slots, log-normal outputs (mean 64, cap 384):
#              both schedulings at 64 req/s (the same load), iteration-level at 352 and 416, request-level at 72
#              and 80 (their limits on the H200, generation's sixth run), 1,000 requests each;
#              $OUT/generation.json, $OUT/generation_server.log
#   servestart the shipped model_repository started as `make serve` starts it, on an empty cache
#              ($SERVE_CACHE to keep one), until its "ready after" line, once per word of $SERVE_RUNS
#              (default "cold"; "cold warm": a second start on the same cache): the terminal in
#              $OUT/servestart_RUN_terminal.log, the whole server log in $OUT/servestart_RUN_full.log
#   guardcost  scripts/guard_cost.sh: the HTTP guard's cost, `launcher serve` with each guard of $GUARDS in turns
#              (default "python none"; "python nginx none" adds nginx, from .gpuenv where the machine has none),
#              $GUARD_MODEL (default googlenet) over HTTP at concurrency 1 and 16, $GUARD_ROUNDS rounds of
#              $GUARD_SECONDS per level: $OUT/guard_cost/<guard><round>.json
#   (transport, serving, varlen, generation: $PRECISION, e.g. bf16, serves every model in that precision;
#   serving: IO_FLOOR=1 serves each model's I/O floor beside it too, serving_bench --io-floor)
#   soak       GoogLeNet served by `python -m opara_core.serving.launcher serve` on ports 18000-18002,
#              scripts/soak.py over gRPC at 1, 8 and 64 ($SOAK_SECONDS each, default 30, and as long a warm-up): errors, wrong
#              answers, host and GPU memory growth
#
# Each step is time-limited, logs to $OUT/<step>.log (OUT defaults to ./out) and
# appends "step rc seconds" to $OUT/steps.txt, so a step that runs out of time
# still leaves its log. The serving stack must be importable: the nvidia-pytriton
# wheel (tritonserver 2.51) and tritonclient on PYTHONPATH, perf_analyzer 2.60 in
# $PERF_ANALYZER, and OPARA_ADMIN_KEY set: on the GPU machine, carry .gpuenv
# (dev/make_gpuenv.sh makes it here); this script sources .gpuenv/setup_env.sh itself
# where it is carried and PERF_ANALYZER is not set yet (a servestart without it
# ended at once on 2026-12-06: "nvidia-pytriton is not installed").
set -u
if [ -z "${PERF_ANALYZER:-}" ] && [ -f .gpuenv/setup_env.sh ]; then
    source .gpuenv/setup_env.sh
fi
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
" && python3 scripts/soak.py --url 127.0.0.1:18001 --protocol grpc --model googlenet --precision bf16 --duration "${SOAK_SECONDS:-30}" \
        --concurrency 1,8,64 --warmup "${SOAK_SECONDS:-30}" --json "$out/soak.json"
    local rc=$?
    kill -TERM $server
    wait $server
    return $rc
}

servestart() {
    # $SERVE_RUNS (default "cold"): one start per word on the same cache, e.g. "cold warm"
    local cache=${SERVE_CACHE:-$(mktemp -d)} run rc=0
    for run in ${SERVE_RUNS:-cold}; do
        local terminal=$out/servestart_${run}_terminal.log start=$SECONDS ready=1
        OPARA_CACHE_DIR=$cache HTTP_PORT=18100 GRPC_PORT=18101 METRICS_PORT=18102 \
            python3 -m opara_core.serving.launcher serve --model-repository model_repository >"$terminal" 2>&1 &
        local server=$!
        while kill -0 $server 2>/dev/null; do
            if grep -q "^ready after " "$terminal"; then ready=0; break; fi
            sleep 1
        done
        echo "== $run: $((SECONDS - start)) s to the ready line (rc $ready)"
        kill -TERM $server 2>/dev/null
        wait $server
        cp .triton/logs/server-18100.log "$out/servestart_${run}_full.log" 2>/dev/null
        [ $ready = 0 ] || { rc=1; break; }
    done
    return $rc
}

instances() {
    local rc=0 n
    for n in ${INSTANCES:-1 2 4}; do
        python3 scripts/serving_bench.py --models googlenet --concurrency 16 --shared-memory none,cuda --requests 400 \
            --instances "$n" --batching "${BATCHING:-preferred}" ${QUEUE_DELAY:+--queue-delay "$QUEUE_DELAY"} \
            --perf-analyzer "${PERF_ANALYZER:-perf_analyzer}" --json "$out/instances_$n.json" --log "$out/instances_${n}_server.log" || rc=1
    done
    return $rc
}

twogpu() {
    local rc=0 where
    for where in one all; do
        ( [ "$where" = one ] && export CUDA_VISIBLE_DEVICES=0
          python3 scripts/serving_bench.py --models googlenet --concurrency 16,32,64 --shared-memory "${TWOGPU_SHM:-none,system}" \
              --requests 400 --instances "${TWOGPU_INSTANCES:-1}" --perf-analyzer "${PERF_ANALYZER:-perf_analyzer}" \
              --json "$out/twogpu_$where.json" --log "$out/twogpu_${where}_server.log" ) || rc=1
    done
    return $rc
}

warmbuild() {
    local repository cache model run parameter rc=0
    repository=$(mktemp -d)
    cache=${WARM_CACHE:-$(mktemp -d)}
    for model in ${WARM_MODELS:-googlenet}; do
        cp -r "model_repository/$model" "$repository/"
        for parameter in ${WARM_PARAMS-fused_lanes=true}; do
            printf '\nparameters { key: "%s" value: { string_value: "%s" } }\n' "${parameter%%=*}" "${parameter#*=}" >>"$repository/$model/config.pbtxt"
        done
    done
    for run in ${WARM_RUNS:-cold warm}; do
        echo "== $run cache ($cache)"
        OPARA_CACHE_DIR=$cache python3 -m opara_core.serving.launcher warm --model-repository "$repository" || rc=1
    done
    return $rc
}

transportexp() {
    local deadline=$((SECONDS + $1 - 15)) rc=0
    bench() {  # name, then serving_bench options; a server takes ~35 s (two instances ~55) before its first row
        local name=$1 left=$((deadline - SECONDS))
        shift
        if [ $left -lt 100 ]; then
            echo "== $name skipped: ${left} s left"
            return
        fi
        echo "== $name: $*"
        python3 scripts/serving_bench.py --models googlenet --requests 200 --perf-analyzer "${PERF_ANALYZER:-perf_analyzer}" \
            --budget $((left - 45)) --json "$out/exp_$name.json" --log "$out/exp_${name}_server.log" "$@" || rc=1
    }
    bench t1 --concurrency 1,16 --shared-memory none,system,cuda --parameter torch_threads=1
    bench t0 --concurrency 1,16 --shared-memory none --parameter torch_threads=0
    bench t1_host --concurrency 1,16 --shared-memory cuda --parameter torch_threads=1 --parameter output_memory=host
    bench t1_cpuonly --concurrency 1,16 --shared-memory none,cuda --parameter torch_threads=1 \
        --parameter FORCE_CPU_ONLY_INPUT_TENSORS=yes
    bench t1_host_x2 --concurrency 16 --shared-memory none,cuda --instances 2 --parameter torch_threads=1 \
        --parameter output_memory=host
    bench t1_host_greedy0 --concurrency 1,16 --shared-memory cuda --batching greedy --queue-delay 0 \
        --parameter torch_threads=1 --parameter output_memory=host
    return $rc
}

GPU_SHARDS=(
    "capture:tests/test_capture.py"
    "fused:tests/test_fused_lanes.py"
    "builds:tests/test_build.py tests/test_choices.py tests/test_profile.py tests/test_segment_compiler.py tests/test_inductor_cache.py"
    "server:tests/test_client.py tests/test_triton_backend.py tests/test_faults.py tests/test_varlen.py tests/test_gpt2.py tests/test_generation.py"
)

gputests() {
    local limit=$1 spec name files pids=() rc=0 pid ignore=(--ignore=tests/test_deploy.py --ignore=tests/test_dockerfile.py)
    shard() {  # name, then pytest's paths and options
        local name=$1
        shift
        OPARA_CACHE_DIR=$(mktemp -d) timeout -s INT $((limit - 15)) python3 -m pytest -p no:cacheprovider -m gpu -v -rfE \
            --tb=short --durations=10 --junitxml="$out/gputests_$name.xml" "$@" >"$out/gputests_$name.log" 2>&1
    }
    for spec in "${GPU_SHARDS[@]}"; do
        name=${spec%%:*} files=${spec#*:}
        shard "$name" $files &
        pids+=($!)
        for file in $files; do ignore+=(--ignore="$file"); done
    done
    shard other tests "${ignore[@]}" &
    pids+=($!)
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    grep -h -E "^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped)" "$out"/gputests_*.log
    return $rc
}

export -f servestart soak instances twogpu warmbuild transportexp gputests
export out

for spec in "$@"; do
    name=${spec%%:*}
    limit=560
    [[ $spec == *:* ]] && limit=${spec#*:}
    case $name in
    tests) step tests "$limit" python3 -m pytest -p no:cacheprovider -m gpu -q -rfE --durations=10 \
        --ignore=tests/test_deploy.py --ignore=tests/test_dockerfile.py ${TESTS:-tests} ;;
    gputests) step gputests "$limit" bash -c "$(declare -p GPU_SHARDS); gputests $limit" ;;
    servertests) step servertests "$limit" python3 -m pytest -p no:cacheprovider -m "gpu or server" -q -rfE --durations=10 \
        tests/test_models.py tests/test_faults.py ;;
    launcher) step launcher "$limit" python3 -m pytest -p no:cacheprovider -q -rfE --durations=5 tests/test_launcher.py \
        tests/test_startup.py -k "gpu_metrics or gpu_detection or explicit_model_control or ready_line" ;;
    csan) step csan "$limit" python3 scripts/race_check.py eager --sanitizer --runs 2 --json "$out/race_eager.json" ;;
    racecheck) step racecheck "$limit" compute-sanitizer --tool racecheck --print-limit 20 \
        python3 scripts/race_check.py graph --model googlenet --replays 2 --autotune off --json "$out/racecheck.json" ;;
    transporttests) step transporttests "$limit" bash -c "python3 -m pytest -p no:cacheprovider -m gpu -q -rfEs \
        tests/test_client.py tests/test_triton_backend.py; a=\$?; python3 -m pytest -p no:cacheprovider -q -rfEs \
        tests/test_models.py -k numpy_2; b=\$?; exit \$((a || b))" ;;
    transport) step transport "$limit" python3 scripts/serving_bench.py --models googlenet --concurrency 1,16 \
        --shared-memory none,system,cuda --requests 200 --perf-analyzer "${PERF_ANALYZER:-perf_analyzer}" \
        --budget "${BUDGET:-$((limit - 45))}" --json "$out/transport.json" --log "$out/transport_server.log" ${PRECISION:+--precision "$PRECISION"} ;;
    transportexp) step transportexp "$limit" bash -c "transportexp $limit" ;;
    serving) step serving "$limit" python3 scripts/serving_bench.py --models "${MODELS:-resnet50,inception_v3,deepfm,bert,t5}" \
        --concurrency 1,16 --shared-memory none,system,cuda --requests 200 --perf-analyzer "${PERF_ANALYZER:-perf_analyzer}" \
        --budget "${BUDGET:-$((limit - 45))}" --json "$out/serving.json" --log "$out/server.log" ${PRECISION:+--precision "$PRECISION"} \
        ${IO_FLOOR:+--io-floor} ;;
    soak) step soak "$limit" bash -c soak ;;
    servestart) step servestart "$limit" bash -c servestart ;;
    warmbuild) step warmbuild "$limit" bash -c warmbuild ;;
    instances) step instances "$limit" bash -c instances ;;
    twogpu) step twogpu "$limit" bash -c twogpu ;;
    fusedtests) step fusedtests "$limit" python3 -m pytest -p no:cacheprovider -m gpu -q -rfE --durations=10 \
        tests/test_fused_lanes.py tests/test_choices.py tests/test_build.py tests/test_capture.py tests/test_profile.py ;;
    bench) step bench "$limit" python3 -m opara_core.bench --models "${BENCH_MODELS:-googlenet,bert}" \
        --batch "${BENCH_BATCH:-1,8,32}" --json "$out/bench.json" ${BENCH_ARGS:-} ;;
    varlentests) step varlentests "$limit" python3 -m pytest -p no:cacheprovider -m gpu -q -rfE --durations=5 \
        tests/test_capture.py tests/test_varlen.py -k "one_pool or on_a_gpu" ;;
    generation) step generation "$limit" python3 scripts/generation_bench.py --requests 1000 --tpot-bound-ms 20 \
        --ttft-bound-ms 2000 --max-active 64 --output-len lognormal:mean=64,cap=384,seed=1 --iteration-rates 64,352,416 \
        --request-rates 64,72,80 --json "$out/generation.json" --log "$out/generation_server.log" ${PRECISION:+--precision "$PRECISION"} ;;
    varlen) step varlen "$limit" python3 scripts/varlen_bench.py --models "${VARLEN_MODELS:-bert}" --concurrency 1,16,64 \
        --json "$out/varlen_bench.json" --log "$out/varlen_server.log" ${PRECISION:+--precision "$PRECISION"} ${VARLEN_ARGS:-} ;;
    guardcost) step guardcost "$limit" bash scripts/guard_cost.sh "${GUARD_MODEL:-googlenet}" "${GUARD_ROUNDS:-2}" "${GUARD_SECONDS:-15}" "$out/guard_cost" ;;
    *) echo "unknown step $name (tests, gputests, fusedtests, bench, servertests, launcher, servestart, csan, racecheck, transporttests, transport, transportexp, serving, instances, twogpu, soak, warmbuild, generation, varlen, varlentests, guardcost)" >&2; exit 2 ;;
    esac
done
