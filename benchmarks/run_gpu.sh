#!/bin/bash
# The GPU measurements behind the README's figures, in groups that each fit a 10-minute call. Each benchmark writes
# its record itself (benchmarks/record.py): benchmarks/results/<machine>/<bench>.json + .txt, <machine> = h200 for
# one H200, h200x2 for two.
#   bash benchmarks/run_gpu.sh rollout1  # 1 GPU: rollout at 64 / 256 / 512 episodes, env work in 8 processes, 5 runs
#                                        #   -> h200/rollout
#   bash benchmarks/run_gpu.sh step1     # 1 GPU: an RL step of the GSM8K smoke recipe, phase by phase -> h200/rl_step
#   bash benchmarks/run_gpu.sh update    # 1 GPU: the update vs raw fwd+bwd+AdamW -> h200/update
#   bash benchmarks/run_gpu.sh tests     # 1 GPU: the CUDA tests (engine, Triton attention, HF backend, trainer math)
#                                        #   -> h200/cuda_tests.txt
#   bash benchmarks/run_gpu.sh exact_tests  # 1 GPU: exact mode's tests on CUDA (Triton kernels, engine = trainer bit
#                                        #   for bit; printed, the output in $EXP/exact_tests.txt)
#   bash benchmarks/run_gpu.sh exact     # 1 GPU: exact mode's cost, on/off -> h200/exact
#   bash benchmarks/run_gpu.sh lora7b    # 1 GPU: the 7B shape's LoRA recipe, 4 RL steps -> h200/rl_step_7b_lora
#   bash benchmarks/run_gpu.sh agent     # 1 GPU: agent workloads A, B and GSM8K, prefix cache on/off -> h200/agent
#   bash benchmarks/run_gpu.sh scaling   # 2 GPUs: DDP check, 1 GPU, 2 GPUs weak/strong, one-step off-policy
#                                        #   -> h200x2/scaling (its runs replace theirs in the record's scaling.json)
#   bash benchmarks/run_gpu.sh fsdp      # 2 GPUs: the 3B shape under FSDP2 -> h200x2/scaling (the same)
# Experiments (not the record: they go to $EXP; what they decide goes to docs/engine.md's table):
#   bash benchmarks/run_gpu.sh exact_step  # 1 GPU: the smoke recipe's RL step in exact mode (EXACT_COMPILE_LAYERS=0:
#                                        #   its layers eager; EXACT_FLASH_BACKWARD=0: the attention's backward by SDPA),
#                                        #   its mismatch at every step and its phases
#                                        #   -> $EXP/rl_step_exact.json
#   bash benchmarks/run_gpu.sh agent_b   # 1 GPU: workload B alone, prefix cache on/off -> $EXP/agent_B.json
#   bash benchmarks/run_gpu.sh exact_update  # 1 GPU: exact mode's cost at an update of the smoke recipe's size (128
#                                        #   sequences of up to 768 tokens, 32k-token micro-batches), with the costliest
#                                        #   operations of each exact phase and of the plain update -> $EXP/exact_update.json
#   bash benchmarks/run_gpu.sh step_profile  # 1 GPU: the smoke recipe's step 5 under torch.profiler: each phase's wall
#                                        #   and device-busy time, its costliest kernels, where the device waited for the
#                                        #   host (issue 29) -> the report printed (STEPS=4: step 4)
#   bash benchmarks/run_gpu.sh exact_one_turn  # 1 GPU: the smoke recipe's step exact on, then off, with single-turn
#                                        #   episodes (rollout.max_turns=1: a tool call's second turn, drawn by chance
#                                        #   with a random model, is not in one run only), 5 steps each
#                                        #   -> $EXP/rl_step_one_turn_exact_{true,false}.json
#   bash benchmarks/run_gpu.sh exact_inline  # 1 GPU: exact_one_turn's run with exact mode's kernels inlined in compiled
#                                        #   code (MT_ENV_EXACT_INLINE=1), then exact on as today, then off
#                                        #   -> $EXP/rl_step_one_turn_exact_{inline,true,false}.json (its tests:
#                                        #   MT_ENV_EXACT_INLINE=1 bash benchmarks/run_gpu.sh exact_tests)
#   bash benchmarks/run_gpu.sh exact_profile [true|false]  # 1 GPU: exact on and off (or one), single-turn episodes,
#                                        #   step 4 of 5 profiled: each phase's costliest kernels and waits
#                                        #   -> $EXP/profile_exact_{true,false}.txt
#   bash benchmarks/run_gpu.sh exact_host  # 1 GPU: the host's cost of exact mode's update on a tiny micro-batch, on and
#                                        #   off (and on with the kernels inlined), and of one matmul call by each
#                                        #   path; cProfile's costliest functions, torch.profiler's costliest operations
#   bash benchmarks/run_gpu.sh step_vocab  # 1 GPU: step1 with the 0.5B's embedding cut to the tokenizer's 151,665
#                                        #   rows (unaligned LM head, as before 2026-12-06) -> $EXP/rl_step_vocab151665.json
#   bash benchmarks/run_gpu.sh exact_sampler  # 1 GPU: exact mode's sampled logprobs recomputed from the trainer's
#                                        #   logits: the test's old backbone call against the trainer's pass (printed)
#   bash benchmarks/run_gpu.sh exact_matmul  # 1 GPU: exact mode's matmul alone at the 0.5B's weight shapes under
#                                        #   several tiles, against cuBLAS (issue 28) -> $EXP/exact_matmul.json
#   bash benchmarks/run_gpu.sh sanitize  # 1 GPU: compute-sanitizer memcheck over the engine's CUDA tests and a small
#                                        #   agent rollout, the caching allocator off (issue 27; no CUDA graphs then:
#                                        #   capture cannot cudaMalloc) -> $EXP/sanitize.txt; SANITIZE_AGENT=0
#                                        #   SANITIZE_TESTS_S=540: the tests alone, with more time; SANITIZE_TESTS_S=0:
#                                        #   the rollout alone
#   bash benchmarks/run_gpu.sh engine_check  # 1 GPU: greedy tokens of the engine against the transformers path
#   bash benchmarks/run_gpu.sh driver256 4 8  # 1 GPU: the driver vs the engine at 256 episodes only (5 runs, no
#                                        # generate), with its env work in 4, then 8 processes (FIRST_STEP=10: steps
#                                        # 10-14, as ab256's first round)
#   bash benchmarks/run_gpu.sh ab256 DIR 4 2  # 1 GPU: the same at 256 episodes for the code in DIR (`git archive <c> |
#                                        # tar -x -C DIR; echo <c> > DIR/COMMIT`, with this checkout's bench_rollout.py
#                                        # and record.py copied in) and this checkout's, in turn, 2 rounds; round r
#                                        # plays steps 10r..10r+4 on both sides (the same token work, paired run by run)
# With $OUT set (the device's output folder) the records go to $OUT/results/<machine>/ (copy them over
# benchmarks/results/) and the experiments to $OUT/experiments; without it, into benchmarks/results/ directly and
# /tmp/mt_env_experiments. Without git metadata (a copy of the tree), set MT_ENV_COMMIT=<sha>[-dirty]. GSM8K is read
# from $MT_ENV_GSM8K. A folder .whl/ of wheels, when present, is installed first (for machines without PyPI).
set -u
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
if [ -z "${MT_ENV_COMMIT:-}" ] && ! git rev-parse HEAD > /dev/null 2>&1; then
  echo "run_gpu.sh: no git metadata here: set MT_ENV_COMMIT=<sha>[-dirty] (git rev-parse HEAD where the tree" \
    "came from)" >&2
  exit 2
fi
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
if [ -n "${OUT:-}" ]; then
  export MT_ENV_RESULTS=$OUT/results
  EXP=$OUT/experiments
fi
RESULTS=${MT_ENV_RESULTS:-benchmarks/results}  # where bench_scaling reads its earlier report
EXP=$(mkdir -p "${EXP:-/tmp/mt_env_experiments}" && realpath "${EXP:-/tmp/mt_env_experiments}")  # also from ab256's DIR

rl_step() {  # the smoke recipe's RL step as the record runs it (compiled layers, 32k-token micro-batches), and "$@"
  timeout 300 python3 benchmarks/bench_rl_step.py --set trainer.compile=true --set trainer.micro_batch_tokens=32768 "$@"
}

rollout256() {  # code dir, env processes, first step, name: the driver vs the engine at 256 episodes, 5 runs
  (cd "$1" && timeout 170 python3 benchmarks/bench_rollout.py --model qwen2.5-0.5b --device cuda --batch 256 \
    --new-tokens 128 --env-processes "$2" --repeats 5 --first-step "$3" --no-hf-static --out "$EXP/$4.json" 2>&1 \
    | grep "^  256\|runs:"; return "${PIPESTATUS[0]}")
}

keep_scaling_runs() {  # the record's scaling report in $RESULTS, so that this call's runs replace only their own
  if [ "$RESULTS" != benchmarks/results ] && [ -f benchmarks/results/h200x2/scaling.json ]; then
    mkdir -p "$RESULTS/h200x2" && cp -n benchmarks/results/h200x2/scaling.json \
      benchmarks/results/h200x2/scaling_runs.jsonl "$RESULTS/h200x2/"
  fi
}

case "${1:-}" in
  rollout1)  # each command prints what its record's .txt holds: the last lines are shown here
    timeout 400 python3 benchmarks/bench_rollout.py --model qwen2.5-0.5b --device cuda --batch 64 256 512 \
      --new-tokens 128 --env-processes 8 --repeats 5 2>&1 | grep -v "Warn\|warn" | tail -24
    echo "bench_rollout rc=${PIPESTATUS[0]}" ;;
  step1)  # the first step of a process compiles the trainer's scoring function (~60 s on a fresh machine)
    rl_step 2>&1 | tail -12; echo "bench_rl_step rc=${PIPESTATUS[0]}" ;;
  step_profile)  # an experiment: steps 1-4 as step1's run, step 5 profiled (left out of the medians; no record)
    rl_step --steps "${STEPS:-5}" --profile-step "${STEPS:-5}" 2>&1 | grep -v "Warn\|warn" | tail -80
    echo "bench_rl_step profile rc=${PIPESTATUS[0]}" ;;
  exact_one_turn)  # an experiment: exact on and off on the same work (docs/exact.md, the tenth session)
    for on in true false; do
      MT_ENV_EXACT_COMPILE_LAYERS=${EXACT_COMPILE_LAYERS:-1} rl_step --set trainer.compile=$([ $on = true ] && echo \
        false || echo true) --set rollout.exact_logprobs=$on --set rollout.max_turns=1 --steps 5 \
        --out "$EXP/rl_step_one_turn_exact_$on.json" 2>&1 | grep "^steady\|^rollout's\|^logprob\|^step \|B parameters"
      echo "bench_rl_step one turn, exact $on: rc=${PIPESTATUS[0]}"
    done ;;
  exact_inline)  # an experiment: exact_one_turn with the kernels inlined (docs/exact.md, the fifteenth session)
    for mode in inline true false; do
      MT_ENV_EXACT_INLINE=$([ $mode = inline ] && echo 1 || echo 0) \
        MT_ENV_EXACT_COMPILE_LAYERS=${EXACT_COMPILE_LAYERS:-1} rl_step --set trainer.compile=$([ $mode = false ] && \
        echo true || echo false) --set rollout.exact_logprobs=$([ $mode = false ] && echo false || echo true) \
        --set rollout.max_turns=1 --steps 5 --out "$EXP/rl_step_one_turn_exact_$mode.json" 2>&1 \
        | grep "^steady\|^rollout's\|^logprob\|^step \|B parameters"
      echo "bench_rl_step one turn, exact $mode: rc=${PIPESTATUS[0]}"
    done ;;
  exact_profile)  # an experiment: exact on and off on single-turn episodes (equal work), step 4 of 5 profiled in each
    # (the kernels of each phase, where the device waited) -> $EXP/profile_exact_{true,false}.txt, the update's printed;
    # `exact_profile true` or `exact_profile false`: one mode (at de08c82 one run with its trace outlasted 200 s)
    for on in ${2:-true false}; do
      MT_ENV_EXACT_COMPILE_LAYERS=${EXACT_COMPILE_LAYERS:-1} rl_step --set trainer.compile=$([ $on = true ] && echo \
        false || echo true) --set rollout.exact_logprobs=$on --set rollout.max_turns=1 --steps 5 --profile-step 4 \
        > "$EXP/profile_exact_$on.txt" 2>&1
      echo "bench_rl_step exact $on profile rc=$? (the report: \$EXP/profile_exact_$on.txt)"
      grep -A5 "^phases" "$EXP/profile_exact_$on.txt"; grep -A8 "kernels launched in .*update" "$EXP/profile_exact_$on.txt"
      grep -A6 "the device waited in .*update" "$EXP/profile_exact_$on.txt"
    done ;;
  exact_host)  # an experiment: where the exact update's host time goes (docs/exact.md)
    timeout "${EXACT_HOST_S:-300}" python3 benchmarks/exact_host.py --device cuda --cprofile 20 --ops 30 --inline 2>&1 \
      | grep -v "Warn\|warn" | tail -200; echo "exact_host rc=${PIPESTATUS[0]}" ;;
  step_vocab)  # an experiment: step1's run with the embedding cut to the tokenizer's 151,665 ids (the shape random-init
    # models had before 2026-12-06: unaligned LM-head matmuls) -> $EXP/rl_step_vocab151665.json
    rl_step --set model.config.vocab_size=151665 --out "$EXP/rl_step_vocab151665.json" 2>&1 | tail -12
    echo "bench_rl_step vocab 151665 rc=${PIPESTATUS[0]}" ;;
  update)
    timeout 280 python3 benchmarks/bench_update.py --device cuda --iters 3 --also-micro-tokens 32768 8192 2>&1 | tail -22
    echo "bench_update rc=${PIPESTATUS[0]}" ;;
  agent)  # the agent workloads (issue 27): prefix cache on and off in one process -> h200/agent
    timeout 560 python3 benchmarks/bench_agent.py --device cuda --workloads A B gsm8k --env-processes 8 2>&1 \
      | grep -v "Warn\|warn" | tail -6; echo "bench_agent rc=${PIPESTATUS[0]}" ;;
  agent_b)  # an experiment: workload B alone, prefix cache on and off in one process (issue 27's B >= 1.4x when a
    # call has no room for the whole record) -> $EXP/agent_B.json
    timeout 250 python3 benchmarks/bench_agent.py --device cuda --workloads B --out "$EXP/agent_B.json" 2>&1 \
      | grep -v "Warn\|warn" | tail -6; echo "bench_agent B rc=${PIPESTATUS[0]}" ;;
  exact_step)  # an experiment: exact mode at the recipe's shape (256 episodes), step1's settings otherwise (exact mode
    # decides compilation: trainer.compile stays off; EXACT_COMPILE_LAYERS=0 runs its layers eagerly on both sides);
    # compare with step1's phases in the same call
    MT_ENV_EXACT_COMPILE_LAYERS=${EXACT_COMPILE_LAYERS:-1} MT_ENV_EXACT_FLASH_BACKWARD=${EXACT_FLASH_BACKWARD:-1} \
      rl_step --set trainer.compile=false \
      --set rollout.exact_logprobs=true --out "$EXP/rl_step_exact.json" 2>&1 | grep -v "Warn\|warn" | tail -12
    echo "bench_rl_step exact rc=${PIPESTATUS[0]}" ;;
  exact_update)  # an experiment: bench_exact at an update of the recipe's size, and where its time goes (issue 28)
    timeout 500 python3 benchmarks/bench_exact.py --device cuda --model qwen2.5-0.5b --batch 128 --prompt 512 \
      --new-tokens 256 --micro-tokens 32768 --repeats 1 --profile 25 --out "$EXP/exact_update.json" 2>&1 \
      | grep -v "Warn\|warn" | tail -150
    echo "bench_exact update rc=${PIPESTATUS[0]}" ;;
  exact_sampler)  # an experiment: where a sampled logprob differs from its recomputation (docs/exact.md)
    MT_ENV_TEST_DEVICE=cuda timeout 200 python3 benchmarks/exact_sampler_check.py --path direct trainer 2>&1 \
      | grep -v "Warn\|warn" | tail -40; echo "exact_sampler_check rc=${PIPESTATUS[0]}" ;;
  exact_matmul)  # an experiment: a tile per weight shape for exact mode's matmul (docs/exact.md)
    timeout 400 python3 benchmarks/bench_exact_matmul.py --out "$EXP/exact_matmul.json" 2>&1 | tail -150
    echo "bench_exact_matmul rc=${PIPESTATUS[0]}" ;;
  sanitize)  # an experiment: memcheck sees out-of-bounds accesses only with the caching allocator off
    if ! command -v compute-sanitizer > /dev/null; then
      PATH=$PATH:/usr/local/cuda/bin
    fi
    command -v compute-sanitizer > /dev/null || { echo "sanitize: no compute-sanitizer on this machine" >&2; exit 3; }
    export PYTORCH_NO_CUDA_MEMORY_CACHING=1 MT_ENV_TEST_DEVICE=cuda MT_ENV_TEST_TIMEOUT_SCALE=10
    { if [ "${SANITIZE_TESTS_S:-330}" != 0 ]; then  # SANITIZE_TESTS_S=0: the agent rollout alone
        timeout "${SANITIZE_TESTS_S:-330}" compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest \
          tests/test_triton_attention.py tests/test_prefix_cache.py -v -p no:cacheprovider; echo "memcheck tests rc=$?"
      fi
      if [ "${SANITIZE_AGENT:-1}" = 1 ]; then  # SANITIZE_AGENT=0: the tests alone (SANITIZE_TESTS_S=540 for them)
        timeout 220 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/bench_agent.py \
          --device cuda --workloads B --scale 0.1 --no-cuda-graphs --out "$EXP/agent_sanitized.json"
        echo "memcheck agent B rc=$?"
      fi; } > "$EXP/sanitize.txt" 2>&1
    grep -E "ERROR SUMMARY|rc=|passed|failed|PASSED|FAILED" "$EXP/sanitize.txt" | tail -30 ;;
  engine_check)  # an experiment: the engine's greedy tokens against the transformers path (docs/engine.md's table)
    timeout 500 python3 benchmarks/gpu_engine_check.py --quick --out "$EXP/gpu_engine_check.json" 2>&1 | tail -20
    echo "gpu_engine_check rc=${PIPESTATUS[0]}" ;;
  tests)
    timeout 500 python3 benchmarks/record.py cuda_tests --device cuda -- env MT_ENV_TEST_DEVICE=cuda python3 -m \
      pytest tests/test_engine.py tests/test_engine_memory_and_fallbacks.py tests/test_engine_sampler.py \
      tests/test_engine_slots.py tests/test_engine_model_runner.py tests/test_engine_compiled_step.py \
      tests/test_prefix_cache.py tests/test_triton_attention.py tests/test_backend_hf.py \
      tests/test_backend_hf_batching.py tests/test_backend_hf_failures.py tests/test_algos.py -q \
      -p no:cacheprovider 2>&1 | tail -4; echo "cuda tests rc=${PIPESTATUS[0]}" ;;
  exact_tests)  # exact mode's CUDA tests (issue 28; ~6 min), the matmul's first
    MT_ENV_TEST_DEVICE=cuda timeout "${EXACT_TESTS_S:-540}" python3 -m pytest tests/test_triton_matmul.py \
      tests/test_exact_inline.py tests/test_exact.py tests/test_exact_sampling.py tests/test_triton_exact.py -q -rfE \
      -p no:cacheprovider \
      > "$EXP/exact_tests.txt" 2>&1
    echo "exact tests rc=$? (the whole output: \$EXP/exact_tests.txt)"; grep -E "^(FAILED|ERROR)|passed|failed" \
      "$EXP/exact_tests.txt" | tail -12 ;;
  exact)  # exact mode (issue 28): engine and trainer-pass throughput with it off and on (the tests: exact_tests)
    timeout 300 python3 benchmarks/bench_exact.py --device cuda --model qwen2.5-0.5b --batch 32 --prompt 128 \
      --new-tokens 32 --repeats 1 --profile 20 2>&1 | grep -v "Warn\|warn" | tail -64
    echo "bench_exact rc=${PIPESTATUS[0]}" ;;
  lora7b)  # the 7B shape's LoRA recipe, 4 RL steps phase by phase -> h200/rl_step_7b_lora
    timeout 500 python3 benchmarks/bench_rl_step.py --config gsm8k_qwen2.5_7b_lora.yaml --steps 4 --warmup 1 \
      --out "${MT_ENV_RESULTS:-benchmarks/results}/h200/rl_step_7b_lora.json" 2>&1 | tail -9
    echo "bench_rl_step 7b lora rc=${PIPESTATUS[0]}" ;;
  scaling)
    keep_scaling_runs
    timeout 590 python3 benchmarks/bench_scaling.py --work /tmp/bench_scaling --budget 560 \
      --only ddp_check,1gpu,2gpu_weak,2gpu_strong,async; echo "bench_scaling rc=$?" ;;
  fsdp)
    keep_scaling_runs
    timeout 590 python3 benchmarks/bench_scaling.py --work /tmp/bench_scaling --budget 560 --only fsdp3b --fsdp3b
    echo "bench_scaling rc=$?" ;;
  driver256)
    shift
    for p in "${@:-4}"; do
      rollout256 . "$p" "${FIRST_STEP:-0}" "rollout_256_p$p"; echo "bench_rollout, $p env processes: rc=$?"
    done ;;
  ab256)
    other=$(realpath "$2"); p=${3:-4}
    for r in $(seq 1 "${4:-2}"); do
      MT_ENV_COMMIT=$(cat "$other/COMMIT" 2> /dev/null || echo unknown) rollout256 "$other" "$p" $((10 * r)) \
        "ab_other_p${p}_r$r"; echo "bench_rollout, other, round $r: rc=$?"
      rollout256 . "$p" $((10 * r)) "ab_this_p${p}_r$r"; echo "bench_rollout, this, round $r: rc=$?"
    done ;;
  *) echo "usage: bash benchmarks/run_gpu.sh rollout1|step1|update|tests|exact|exact_tests|lora7b|agent|agent_b|scaling|fsdp|exact_step|exact_update|exact_one_turn|exact_profile|exact_host|step_profile|step_vocab|exact_sampler|exact_matmul|sanitize|engine_check|driver256|ab256" >&2
     exit 2 ;;
esac
