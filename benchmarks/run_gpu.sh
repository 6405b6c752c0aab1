#!/bin/bash
# The GPU measurements behind the README's figures, in the groups they were run (each fits a 10-minute call).
#   bash benchmarks/run_gpu.sh rollout1  # 1 GPU: rollout at 64 / 256 / 512 episodes (env work in 8 processes)
#                                        # with generate + CUDA tests
#   bash benchmarks/run_gpu.sh driver256 4 8  # 1 GPU: the driver vs the engine at 256 episodes only (5 runs, no
#                                        # generate), with its env work in 4, then 8 processes (FIRST_STEP=10: steps
#                                        # 10-14, as ab256's first round)
#   bash benchmarks/run_gpu.sh ab256 DIR 4 2  # 1 GPU: the same at 256 episodes for the code in DIR (e.g. `git archive
#                                        # <commit> | tar -x -C DIR`, with this checkout's bench_rollout.py copied in)
#                                        # and this checkout's, in turn, 2 rounds; round r plays steps 10r..10r+4 on
#                                        # both sides (the same token work, paired run by run)
#   bash benchmarks/run_gpu.sh step1     # 1 GPU: RL step + prefill passes by shape, profiled + CUDA trainer tests
#   bash benchmarks/run_gpu.sh single    # 2 GPUs, one chain each: engine check + rollout (env work in 4
#                                        # processes, then in one) | CUDA tests + RL step
#   python3 benchmarks/profile_rollout.py --batch 256 --timeline --env-processes 4   # where the driver loses time
#   python3 benchmarks/bench_prefill.py --profile      # prefill passes by shape: first time vs repeated
#   bash benchmarks/run_gpu.sh scaling   # 2 GPUs: DDP check, 1 GPU, 2 GPUs weak/strong, one-step off-policy
#   bash benchmarks/run_gpu.sh fsdp      # 2 GPUs: the 3B shape under FSDP2
#   bash benchmarks/run_gpu.sh driver    # 2 GPUs: bench_rollout | the driver with HFPolicy's defaults, with
#                                        # a bounded admission wait, a longer gather (other knobs: bench_rollout.py --help)
# Results go to $OUT (default benchmarks/results/run; the driver variants keep their JSON in /tmp); GSM8K is read
# from $MT_ENV_GSM8K. A folder .whl/ of wheels, when present, is installed first (for machines without PyPI).
set -u
OUT=${OUT:-benchmarks/results/run}
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
mkdir -p "$OUT"
OUT=$(realpath "$OUT")  # the same folder from another code's directory (ab256)

single_gpu0() {
  timeout 200 python3 benchmarks/gpu_engine_check.py --quick --out "$OUT/gpu_engine_check.json" \
    > "$OUT/gpu_engine_check.txt" 2>&1; echo "gpu_engine_check rc=$?"
  timeout 260 python3 benchmarks/bench_rollout.py --model qwen2.5-0.5b --device cuda --batch 64 256 \
    --new-tokens 128 --env-processes 4 --repeats 3 --out "$OUT/rollout.json" > "$OUT/rollout.txt" 2>&1; echo "bench_rollout rc=$?"
  timeout 150 python3 benchmarks/bench_rollout.py --model qwen2.5-0.5b --device cuda --batch 64 256 \
    --new-tokens 128 --no-hf-static --out "$OUT/rollout_inprocess.json" > "$OUT/rollout_inprocess.txt" 2>&1
  echo "bench_rollout (env work in this process) rc=$?"
}

single_gpu1() {
  MT_ENV_TEST_DEVICE=cuda timeout 150 python3 -m pytest tests/test_fast_decode.py tests/test_policy_hf.py -q -x \
    -p no:cacheprovider > "$OUT/cuda_tests.txt" 2>&1; echo "cuda tests rc=$?"
  timeout 270 python3 benchmarks/bench_rl_step.py --out "$OUT/rl_step.json" > "$OUT/rl_step.txt" 2>&1
  echo "bench_rl_step rc=$?"
}

rollout256() {  # code dir, env processes, first step, name: the driver vs the engine at 256 episodes, 5 runs
  (cd "$1" && timeout 170 python3 benchmarks/bench_rollout.py --model qwen2.5-0.5b --device cuda --batch 256 \
    --new-tokens 128 --env-processes "$2" --repeats 5 --first-step "$3" --no-hf-static --out "$OUT/$4.json" \
    > "$OUT/$4.txt" 2>&1)
  local rc=$?; grep "^  256\|runs:" "$OUT/$4.txt"; return $rc
}

case "${1:-}" in
  rollout1)
    timeout 400 python3 benchmarks/bench_rollout.py --model qwen2.5-0.5b --device cuda --batch 64 256 512 \
      --new-tokens 128 --env-processes 8 --repeats 5 --out "$OUT/rollout.json" > "$OUT/rollout.txt" 2>&1
    echo "bench_rollout rc=$?"; grep -v "Warn\|warn" "$OUT/rollout.txt" | tail -24
    MT_ENV_TEST_DEVICE=cuda timeout 170 python3 -m pytest tests/test_fast_decode.py tests/test_policy_hf.py \
      -q -x -p no:cacheprovider > "$OUT/cuda_tests.txt" 2>&1; echo "cuda tests rc=$?"  # the trainer's: step1
    tail -4 "$OUT/cuda_tests.txt" ;;
  driver256)
    shift
    for p in "${@:-4}"; do
      rollout256 . "$p" "${FIRST_STEP:-0}" "rollout_256_p$p"; echo "bench_rollout, $p env processes: rc=$?"
    done ;;
  ab256)
    other=$(realpath "$2"); p=${3:-4}
    for r in $(seq 1 "${4:-2}"); do
      rollout256 "$other" "$p" $((10 * r)) "ab_other_p${p}_r$r"; echo "bench_rollout, other, round $r: rc=$?"
      rollout256 . "$p" $((10 * r)) "ab_this_p${p}_r$r"; echo "bench_rollout, this, round $r: rc=$?"
    done ;;
  step1)
    timeout 200 python3 benchmarks/bench_rl_step.py --out "$OUT/rl_step.json" > "$OUT/rl_step.txt" 2>&1
    echo "bench_rl_step rc=$?"; tail -9 "$OUT/rl_step.txt"
    # caches of its own, cold on a fresh machine: the first pass of each shape is what bench_prefill measures
    TORCHINDUCTOR_CACHE_DIR=/tmp/ic-prefill TRITON_CACHE_DIR=/tmp/tc-prefill timeout 200 python3 \
      benchmarks/bench_prefill.py --profile --out "$OUT/prefill_profile.json" > "$OUT/prefill_profile.txt" 2>&1
    echo "bench_prefill rc=$?"
    MT_ENV_TEST_DEVICE=cuda timeout 100 python3 -m pytest tests/test_algos.py -q -x -p no:cacheprovider \
      > "$OUT/cuda_tests_algos.txt" 2>&1; echo "cuda tests rc=$?"; tail -2 "$OUT/cuda_tests_algos.txt" ;;
  single)
    CUDA_VISIBLE_DEVICES=0 single_gpu0 & CUDA_VISIBLE_DEVICES=1 single_gpu1 & wait
    tail -40 "$OUT/gpu_engine_check.txt"; tail -25 "$OUT/rollout.txt"; tail -5 "$OUT/cuda_tests.txt"
    tail -30 "$OUT/rl_step.txt" ;;
  scaling)
    timeout 590 python3 benchmarks/bench_scaling.py --out "$OUT" --work /tmp/bench_scaling --budget 560 \
      --only ddp_check,1gpu,2gpu_weak,2gpu_strong,async; echo "bench_scaling rc=$?" ;;
  fsdp)
    timeout 590 python3 benchmarks/bench_scaling.py --out "$OUT" --work /tmp/bench_scaling --budget 560 \
      --only fsdp3b --fsdp3b; echo "bench_scaling rc=$?" ;;
  driver)
    variant() {  # name, GPU, bench_rollout flags
      CUDA_VISIBLE_DEVICES=$2 timeout 170 python3 benchmarks/bench_rollout.py --model qwen2.5-0.5b --device cuda \
        --batch 64 256 --new-tokens 128 --no-hf-static "${@:3}" --out "/tmp/driver_$1.json" > "$OUT/driver_$1.txt" 2>&1
      echo "driver $1 rc=$?"
    }
    { CUDA_VISIBLE_DEVICES=0 timeout 240 python3 benchmarks/bench_rollout.py --model qwen2.5-0.5b --device cuda \
        --batch 64 256 --new-tokens 128 --out "$OUT/rollout.json" > "$OUT/rollout.txt" 2>&1; echo "rollout rc=$?"; } &
    { variant default 1; variant wait8 1 --admit-wait-steps 8; variant cap100 1 --gather-cap 100; } &
    wait
    for f in "$OUT"/rollout.txt "$OUT"/driver_*.txt; do echo "== $f"; grep -A12 "^batch" "$f" | grep -v Warn; tail -2 "$f"; done ;;
  *) echo "usage: bash benchmarks/run_gpu.sh rollout1|driver256|ab256|step1|single|scaling|fsdp|driver" >&2; exit 2 ;;
esac
