#!/usr/bin/env bash
# The whole GPU check of zinfjax on a bare GPU machine with no network, in one command:
#
#   scripts/gpu_check.sh OUT [STAGES] [--dry-run]
#
# STAGES, comma-separated, run in the order given (default env,build,gpu-tests,bench,cpu-suite):
#   env          the machine, the driver, the versions (env.txt)
#   build        zinfjax with its CUDA handlers (build.log)
#   gpu-tests    tests/gpu, the tests never yet passed on a GPU first (gpu_tests.log); GPU_TESTS_K
#                picks some by pytest's -k (all 26 take about 330 s on an H100)
#   speed        the numbers of the GPU speed issue: MFU and pinned host (the host pipeline under
#                backward, with the embedding's update or every update one step late, and with
#                bf16 moments; SPEED_PLACEMENTS picks other bench_gpu.py rows) at 16k and 64k
#                tokens, with the host's side alone, each row in its own process (speed.log,
#                speed/bench_gpu.json)
#   families     the all-device step of Llama 3.1 8B (4 layers), Gemma 3 1B (6) and Gemma 2 2B (4,
#                8k sequences: explicit attention in blocks) from data/shapes, random init: MFU by
#                the Llama family's count (families_*.log); FAMILY_PLACEMENTS adds bench_gpu.py
#                rows (e.g. device,pipeline-under), FAMILIES picks models
#   bench        every row of bench_gpu.py: copies, disk, steps, NVMe's against I/O alone, each step
#                row in its own process (bench_gpu.log, bench_gpu.json)
#   copy-stream  the host-pipeline step (and NVMe's with COPY_PLACEMENTS=device,pipeline-under,nvme)
#                with the swap copies on XLA's stream, then on the copy stream (every other stage
#                runs them there, the default): ZINFJAX_COPY_STREAM=0/1, or those COPY_MODES
#                names (copy_stream_*.log)
#   profile      a jax.profiler trace of the bench GPT, all on device and on pinned host under the
#                host pipeline, and the top kernels by time as text (profile_device.txt,
#                profile_pinned_host.txt)
#   ckpt         checkpoint save/restore per tier on the GPU, about 3 minutes (bench_checkpoint.log)
#   largest      RAM's store on init's path alone (ram_store.log, a few seconds), numpy's
#                crossings to and from the device (copies.log, a few seconds), then
#                the largest GPT per placement, 3 steps each; LARGEST="nvme" or "mixed" picks
#                placements (one per call fits); LARGEST_ARGS adds flags, e.g.
#                "--bf16-moments --hidden 5120 --layers 42" (largest_gpt.log); under DEADLINE, the
#                runs stop 30 s before it (the steps they finished are in the table), and a run
#                the host kills for memory is tried again with 20 GiB more RAM kept back if a
#                minute is left
#   peer         DeepSpeed ZeRO-3 offload and zinfjax on the same GPT and shapes, one table
#                (peer_table.txt); deepspeed comes from the bundle scripts/peer_bundle.sh makes in
#                build/peer (carry it); PEER_PLACEMENTS a subset of device,cpu,nvme (split the
#                placements over calls, both sides in each, so each table compares one machine:
#                device,cpu then nvme); PEER_SIDES="ours" or "deepspeed" runs one side alone;
#                PEER_CPU_KEYS, zinfjax's bench_gpu.py rows beside DeepSpeed's cpu offload (default
#                "pinned pipeline-under": XLA's host update and the host pipeline under backward)
#   cpu-confirm  the CPU tests that failed under jax 0.11 before their fixes, on this machine's
#                jax with JAX_PLATFORMS=cpu (cpu_confirm.log)
#   cpu-suite    the whole CPU suite with JAX_PLATFORMS=cpu (cpu_suite.log)
#   first        the plan for one call of a 15-minute device budget: env,build,speed,gpu-tests
#                with DEADLINE=560, KEEP_GOING=1 and PACK=1, the GPU tests of the host pipeline,
#                the copy stream, every placement (host_optimizer "auto" and "xla") and cuDNN's
#                attention alone (run it with the device tool's timeout_s=600)
#   second       the plan for one call of the peer / largest-model issue: env,build,largest,peer
#                with DEADLINE=560, KEEP_GOING=1, PACK=1, LARGEST=mixed at 42 layers of hidden
#                5120 with bf16 moments (13.2B), LARGEST_S=300, PEER_PLACEMENTS=device,cpu and
#                PEER_CPU_KEYS=pipeline-under (each may be set otherwise; carry build/peer;
#                timeout_s=600)
#
# DEADLINE=S    every stage ends by S seconds after the start: a stage's time limit is cut to what
#               is left, a stage with under 30 s left is not started (listed in the summary)
# KEEP_GOING=1  a failed stage is reported and the next one runs (a failed build still stops)
# LARGEST_S=S   the largest stage ends by S seconds after its start (its runs stop 30 s before),
#               so the stages after it keep the rest of the deadline
# PACK=1        at the end, every log goes into OUT/logs.tgz (traces and swap files left out), so
#               what comes back is a few files: progress.txt, logs.tgz, speed.json, gpu_tests.log
# --dry-run     on a machine without a GPU: checks that every stage's commands exist and run (GPU
#               tests skipped, benchmarks at tiny sizes), builds nothing; alone, it runs
#               env,gpu-tests,speed,bench,families,ckpt,largest,profile,peer,copy-stream,
#               cpu-confirm
#
# Each stage writes its log under OUT and lines to OUT/progress.txt, with the seconds it took.
# The first failure stops the check (unless KEEP_GOING=1) and names the stage and its log.
# Exit status: 0 all stages passed, 1 a stage failed, 2 an unknown stage, 3 none failed but the
# deadline left some not started.
set -Eeuo pipefail

OUT=${1:?usage: scripts/gpu_check.sh OUT [STAGES] [--dry-run]}
STAGES=${2:-env,build,gpu-tests,bench,cpu-suite}
DRY=0
TINY=(--tiny --tokens 64 --nvme-tokens 64)  # a dry run's benchmark rows: one small token count
if [[ "$STAGES" == "--dry-run" ]]; then
  DRY=1
  STAGES=env,gpu-tests,speed,bench,families,ckpt,largest,profile,peer,copy-stream,cpu-confirm
elif [[ "${3:-}" == "--dry-run" ]]; then
  DRY=1
fi
if [[ "$STAGES" == first ]]; then
  STAGES=env,build,speed,gpu-tests
  DEADLINE=${DEADLINE:-560} KEEP_GOING=${KEEP_GOING:-1} PACK=${PACK:-1}
  FIRST_K="host_pipeline or delayed_update or copy_stream or every_placement or cudnn"
  GPU_TESTS_K=${GPU_TESTS_K-$FIRST_K}
elif [[ "$STAGES" == second ]]; then
  STAGES=env,build,largest,peer
  DEADLINE=${DEADLINE:-560} KEEP_GOING=${KEEP_GOING:-1} PACK=${PACK:-1} LARGEST=${LARGEST:-mixed}
  LARGEST_ARGS=${LARGEST_ARGS-"--bf16-moments --hidden 5120 --heads 40 --layers 42"}
  LARGEST_S=${LARGEST_S:-300} PEER_PLACEMENTS=${PEER_PLACEMENTS:-device,cpu}
  PEER_CPU_KEYS=${PEER_CPU_KEYS:-pipeline-under}
fi
DEADLINE=${DEADLINE:-0} KEEP_GOING=${KEEP_GOING:-0} PACK=${PACK:-0} LARGEST_S=${LARGEST_S:-0}
KNOWN=" env build gpu-tests speed bench families copy-stream profile ckpt largest peer "
KNOWN+="cpu-confirm cpu-suite "
for s in ${STAGES//,/ }; do  # a misspelt stage is found before any device time is spent
  [[ "$KNOWN" == *" $s "* ]] || {
    echo "gpu_check: unknown stage \"$s\"; choose from:$KNOWN(or first, second)" >&2; exit 2; }
done
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# grow GPU memory on demand: the tests start workers beside the pytest process, and peaks are read
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if [[ -z "${CUDAToolkit_ROOT:-}" && -d /usr/local/cuda ]]; then export CUDAToolkit_ROOT=/usr/local/cuda; fi
T0=$(date +%s)
SUMMARY=() FAILED=() MISSED=()

note() { echo "[gpu_check $(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/progress.txt"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
# runs a stage's command with a time limit (cut to the deadline), its output to the log and the console
run() {
  local log=$1 limit=$2
  shift 2
  if (( DEADLINE > 0 )); then
    local room=$(( $(left) - 5 ))
    if (( room < limit )); then limit=$room; fi
    if (( limit <= 0 )); then echo "no time left before the deadline" | tee "$OUT/$log"; return 124; fi
  fi
  set -o pipefail
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$log"  # KILL 10 s after a TERM it ignores
}

stage_env() {
  {
    date -u
    uname -a
    nvidia-smi || echo "nvidia-smi: not available"
    nproc; free -g; df -h "$REPO" /dev/shm || true
    # the host's CPU and vector ISA: the C++ AdamW's speed (bf16 moments above all) follows it
    lscpu 2>/dev/null | grep -E "^(Model name|Socket|Core|Thread|NUMA node\(s\)|L3)" || true
    if grep -qw avx512f /proc/cpuinfo; then echo "cpu: avx512f"; else echo "cpu: no avx512f"; fi
    $PY --version
    (cd /tmp && $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())")
    $PY -m pip list 2>/dev/null | grep -iE "^(jax|flax|optax|orbax|tensorstore|pybind11|scikit-build|torch|cupy|pytest)" || true
    command -v nvcc && nvcc --version | tail -2 || echo "nvcc: not found"
    command -v fio || echo "fio: not found (the disk ceiling falls back to dd)"
  } > "$OUT/env.txt" 2>&1
  note "env: $(grep -m1 -E '^\[|Cuda|cpu' "$OUT/env.txt" | head -c 200)"
}

stage_build() {
  if [[ $DRY == 1 ]]; then note "build: not run in a dry run"; return 0; fi
  run build.log 480 $PY -m pip install --no-deps --no-build-isolation -v "$REPO"
  grep -q "building CUDA handlers" "$OUT/build.log" || { note "the CUDA toolkit was not found: no CUDA handlers built"; false; }
  (cd /tmp && $PY -c "from zinfjax import _engine_cuda; n = _engine_cuda.device_count(); print('CUDA devices:', n); assert n >= 1")
  note "build: zinfjax installed with its CUDA handlers; the C++ AdamW runs $(cd /tmp && $PY -c "from zinfjax.optim.kernel import isa; print(isa())")"
}

stage_gpu_tests() {
  if [[ $DRY == 0 ]]; then
    (cd /tmp && $PY -c "import jax; assert jax.devices('gpu'), 'jax sees no GPU'")
  fi
  local per_test=()  # a hang fails its test, not the whole check
  if $PY -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout 240); fi
  # one worker process: a test that crashes it (a segfault in a CUDA path) fails alone, and
  # xdist starts another worker for the tests after it
  if $PY -c "import xdist" 2>/dev/null; then per_test+=(-n 1); fi
  # -v: a line per test as it ends, so a run cut at its time limit still says which passed
  if [[ -n "${GPU_TESTS_K:-}" ]]; then per_test+=(-k "$GPU_TESTS_K"); fi
  run gpu_tests.log 450 $PY -P -m pytest -v -p no:cacheprovider tests/gpu -ra "${per_test[@]}"
  if [[ $DRY == 0 ]] && grep -qE "[0-9]+ skipped" "$OUT/gpu_tests.log"; then
    note "GPU tests were skipped on a GPU machine: see gpu_tests.log"
    false
  fi
  if [[ $DRY == 1 ]]; then
    grep -q "needs a CUDA GPU" "$OUT/gpu_tests.log" || { note "GPU tests were not skipped with their reason"; false; }
  fi
  note "gpu-tests: $(tail -1 "$OUT/gpu_tests.log")"
}

stage_speed() {
  # the issue's shape for the MFU target: hidden 2048, seq 2048 (--tiny shrinks both)
  local sizes=(--tokens 16384,65536 --seq-len 2048)
  if [[ $DRY == 1 ]]; then sizes=("${TINY[@]}"); fi
  local rows=device,pipeline-under,pipeline-delayed,pipeline-delayed-all,pipeline-delayed-all-bf16
  run speed.log 420 $PY scripts/bench_gpu.py --out "$OUT/speed" --isolate 150 \
    --sections matmul,copies.memory_kinds,host,steps --placements "${SPEED_PLACEMENTS:-$rows}" \
    "${sizes[@]}"
  note "speed: table in speed.log, numbers in speed/bench_gpu.json"
}

stage_bench() {
  if [[ $DRY == 1 ]]; then
    run bench_gpu.log 600 $PY scripts/bench_gpu.py --out "$OUT" --isolate 200 "${TINY[@]}"
  else
    run bench_gpu.log 600 $PY scripts/bench_gpu.py --out "$OUT" --isolate 200
  fi
  note "bench: table in bench_gpu.log, numbers in bench_gpu.json"
}

stage_families() {
  local name size shape
  for name in ${FAMILIES:-llama3-8b gemma3-1b gemma2-2b}; do
    case $name in  # its layers and sequence; the test checkpoint of its family for a dry run
      llama3-8b) size=(--layers 4 --seq-len 2048) shape=llama3;;
      gemma3-1b) size=(--layers 6 --seq-len 2048) shape=gemma3;;
      *) size=(--layers 4 --seq-len 8192) shape=gemma2;;
    esac
    if [[ $DRY == 1 ]]; then shape=$REPO/tests/data/hf/$shape size=("${TINY[@]}")
    else shape=$REPO/data/shapes/$name size+=(--tokens 16384); fi
    (cd /tmp && run "families_$name.log" 240 $PY "$REPO/scripts/bench_gpu.py" --isolate 200 \
       --out "$OUT/families_$name" --sections matmul,steps --init-from "$shape" \
       --placements "${FAMILY_PLACEMENTS:-device}" "${size[@]}")
  done
  note "families: tables in $(printf 'families_%s.log ' ${FAMILIES:-llama3-8b gemma3-1b gemma2-2b})"
}

stage_copy_stream() {
  local mode sizes placements=${COPY_PLACEMENTS:-device,pipeline-under}
  for mode in ${COPY_MODES:-0 1}; do
    if [[ $DRY == 1 ]]; then sizes=("${TINY[@]}"); else sizes=(--tokens 16384); fi
    ZINFJAX_COPY_STREAM=$mode run "copy_stream_$mode.log" 280 $PY scripts/bench_gpu.py --isolate 200 \
      --out "$OUT/copy_stream_$mode" --sections steps --placements "$placements" "${sizes[@]}"
  done
  note "copy-stream: $(printf 'copy_stream_%s.log ' ${COPY_MODES:-0 1})(0: XLA's stream, 1: the copy stream)"
}

stage_profile() {
  local where extra
  for where in device pinned_host; do
    extra=()
    if [[ $DRY == 1 ]]; then extra=(--tiny); fi
    if [[ $where == pinned_host ]]; then extra+=(--host-optimizer pipeline); fi
    (cd /tmp && run "profile_$where.txt" 280 $PY "$REPO/scripts/profile_step.py" \
       --out "$OUT/profile_$where" --offload "$where" "${extra[@]}")
    rm -rf "$OUT/profile_$where/nvme"
  done
  note "profile: top kernels in profile_device.txt and profile_pinned_host.txt, traces under profile_*/trace"
}

stage_ckpt() {
  local dir=${CKPT_DIR:-$(mktemp -d /tmp/zinfjax-ckpt-XXXX)} size  # on the machine's disk, not in OUT
  if [[ $DRY == 1 ]]; then
    size=(--layers 2 --hidden 64 --heads 2 --rounds 1 --probe $((64 << 20)))
  else  # a checkpoint of 2.7 GB (226M params), restored through the staging regions
    size=(--layers 32 --hidden 768 --heads 12 --rounds 3)
  fi
  (cd /tmp && run bench_checkpoint.log 420 $PY "$REPO/scripts/bench_checkpoint.py" --devices 1 \
     --folder "$dir" "${size[@]}") || { rm -rf "$dir"; false; }
  rm -rf "$dir"
  note "ckpt: table in bench_checkpoint.log"
}

stage_largest() {
  local dir=${BIG_DIR:-$(mktemp -d /tmp/zinfjax-largest-XXXX)} size=()  # the swap store, on the machine's disk
  local stop=$(( LARGEST_S > 0 ? $(date +%s) + LARGEST_S : 0 ))
  # seconds to the stage's end: LARGEST_S's or the deadline's, whichever comes first
  until_end() {
    local s=$(( stop > 0 ? stop - $(date +%s) : 1 << 30 ))
    if (( DEADLINE > 0 && $(left) < s )); then s=$(left); fi
    echo $s
  }
  if [[ $DRY == 1 ]]; then
    size=(--hidden 128 --heads 4 --seq-len 64 --batch-size 4 --devices 2 --hbm-gib 0.02
          --ram-gib 0.03 --disk-gib 0.05 --pinned-budget 64)
  fi
  # RAM's store on init's path on this host's cores first (a few seconds): what its init rests on
  local ram=(--gib 4 --repeats 1)
  if [[ $DRY == 1 ]]; then ram=(--gib 0.05 --shard-mib 8 --repeats 1); fi
  (cd /tmp && run ram_store.log 60 $PY "$REPO/scripts/bench_ram_store.py" "${ram[@]}") \
    || note "largest: the RAM store bench failed (ram_store.log); the largest run goes on"
  # and the crossings between numpy and the device its step makes (copies.log, a few seconds)
  local tiny=(); if [[ $DRY == 1 ]]; then tiny=(--tiny); fi
  (cd /tmp && run copies.log 120 $PY "$REPO/scripts/bench_gpu.py" --out "$OUT/copies" \
     --sections copies.ceiling,copies.numpy "${tiny[@]}") \
    || note "largest: the copies bench failed (copies.log); the largest run goes on"
  if (( DEADLINE > 0 || stop > 0 )); then  # the runs stopped before the end with the steps they
    # finished; a second only for a run the host killed for memory (more RAM kept back) or failed
    size+=(--tries 2 --deadline $(( $(until_end) - 30 )))
  fi
  # LARGEST_ARGS: more largest_gpt.py flags, e.g. "--bf16-moments --hidden 5120 --heads 40"
  local limit
  limit=$(( $(until_end) - 5 )); limit=$(( limit < 590 ? limit : 590 ))
  if (( limit < 1 )); then note "largest: no time left for its runs"; rm -rf "$dir"; return 124; fi
  (cd /tmp && run largest_gpt.log $limit $PY "$REPO/scripts/largest_gpt.py" --out "$OUT/largest" \
     --nvme-path "$dir" --placements ${LARGEST:-device pinned_host nvme} "${size[@]}" \
     ${LARGEST_ARGS:-}) \
     || { rm -rf "$dir"; false; }
  rm -rf "$dir"
  note "largest: table in largest_gpt.log, every run in largest/largest_gpt.json"
}

stage_peer() {
  local dir=${PEER_DIR:-$REPO/build/peer} sides=${PEER_SIDES:-ours,deepspeed} placements
  local ours_size peer_size placement key keys
  if [[ -d "$dir/libaio" ]]; then  # DeepSpeed's NVMe offload builds and links against -laio
    export CPATH="$dir/libaio/include${CPATH:+:$CPATH}" \
           LIBRARY_PATH="$dir/libaio/lib${LIBRARY_PATH:+:$LIBRARY_PATH}" \
           LD_LIBRARY_PATH="$dir/libaio/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
           CFLAGS="-I$dir/libaio/include" LDFLAGS="-L$dir/libaio/lib"
  fi
  if [[ $DRY == 1 ]]; then
    placements=${PEER_PLACEMENTS:-device,cpu}
    ours_size=("${TINY[@]}") peer_size=(--dry-run)
  else
    placements=${PEER_PLACEMENTS:-device,cpu,nvme}
    ours_size=(--tokens 16384 --nvme-tokens 16384) peer_size=(--tokens 16384)
  fi
  if [[ ",$sides," == *",ours,"* ]]; then
    for placement in ${placements//,/ }; do  # one process per placement: its own peaks
      case $placement in device) keys="device";; cpu) keys=${PEER_CPU_KEYS:-pinned pipeline-under};;
        nvme) keys="nvme";; esac
      for key in $keys; do
        (cd /tmp && run "peer_ours_$key.log" 300 $PY "$REPO/scripts/bench_gpu.py" --out "$OUT/peer_ours_$key" \
           --sections matmul,steps --placements "$key" "${ours_size[@]}")
      done
    done
  fi
  if [[ ",$sides," == *",deepspeed,"* ]]; then
    local installed=1
    if ! (cd /tmp && $PY -c "import deepspeed" 2>/dev/null) && [[ -d "$dir/wheels" ]]; then
      $PY -m pip install -q --no-index --find-links "$dir/wheels" deepspeed > "$OUT/peer_install.log" 2>&1 \
        || { installed=0; note "peer: installing deepspeed from $dir failed: $(grep -m1 ERROR "$OUT/peer_install.log")"; }
    fi
    if (( ! installed )) && [[ $DRY == 0 ]]; then
      false  # a bundle that does not install here: peer_bundle.sh for this machine's Python
    elif (cd /tmp && $PY -c "import deepspeed, torch" 2>/dev/null); then
      run peer_deepspeed.log 560 $PY "$REPO/scripts/peer_deepspeed.py" --out "$OUT" \
        --placements "$placements" "${peer_size[@]}"
    elif [[ $DRY == 1 ]]; then
      note "peer: torch or deepspeed is not installed here: the DeepSpeed side is not run"
    else
      note "peer: no deepspeed and no bundle in $dir: run scripts/peer_bundle.sh here and carry build/peer"
      false
    fi
  fi
  if [[ -f "$OUT/peer_deepspeed.json" ]] && compgen -G "$OUT/peer_ours_*/bench_gpu.json" > /dev/null; then
    $PY "$REPO/scripts/peer_deepspeed.py" --compare "$OUT/peer_deepspeed.json" \
      --ours "$OUT"/peer_ours_*/bench_gpu.json | tee "$OUT/peer_table.txt"
  fi
  note "peer: $(ls "$OUT"/peer_table.txt "$OUT"/peer_deepspeed.json "$OUT"/peer_ours_*/bench_gpu.json 2>/dev/null | xargs -n1 basename | sort -u | tr '\n' ' ')"
}

# the jax-0.11 failures of the first GPU machine's CPU suite: fp32 placements against optax
# (tests/test_placement.py) and train_gpt.py's host memory on NVMe against its pinned budget
stage_cpu_confirm() {
  local workers=() what=(tests/test_placement.py
    tests/test_scripts.py::test_train_gpt_nvme_keeps_host_memory_within_the_pinned_budget)
  if $PY -c "import xdist" 2>/dev/null; then workers=(-n "$(( $(nproc) > 8 ? 8 : $(nproc) ))" --dist loadfile); fi
  if [[ $DRY == 1 ]]; then workers=(--collect-only); fi
  JAX_PLATFORMS=cpu run cpu_confirm.log 300 $PY -P -m pytest -q -p no:cacheprovider "${what[@]}" "${workers[@]}"
  note "cpu-confirm: $(tail -1 "$OUT/cpu_confirm.log")"
}

stage_cpu_suite() {
  local workers=()
  if $PY -c "import xdist" 2>/dev/null; then workers=(-n "$(( $(nproc) > 8 ? 8 : $(nproc) ))" --dist loadfile); fi
  JAX_PLATFORMS=cpu run cpu_suite.log 900 $PY -P -m pytest -q -p no:cacheprovider --ignore=tests/gpu "${workers[@]}"
  note "cpu-suite: $(tail -1 "$OUT/cpu_suite.log")"
}

# every log into OUT/logs.tgz, beside a few files read first: the device tool brings back 8 files
pack() {
  if [[ -f "$OUT/speed/bench_gpu.json" ]]; then cp "$OUT/speed/bench_gpu.json" "$OUT/speed.json"; fi
  local tgz
  tgz=$(mktemp /tmp/gpu_check_logs-XXXX.tgz)
  tar czf "$tgz" -C "$OUT" --exclude=trace --exclude=nvme .
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name progress.txt ! -name speed.json ! -name gpu_tests.log \
    -exec rm -rf {} +
  chmod 644 "$tgz"
  mv "$tgz" "$OUT/logs.tgz"
}

finish() {
  local rc=0
  note "summary: ${SUMMARY[*]:-nothing ran}"
  if [[ -f "$OUT/speed.log" ]]; then sed -n '/^| tokens/,$p' "$OUT/speed.log"; fi
  if [[ -f "$OUT/gpu_tests.log" ]]; then sed -n '/short test summary/,$p' "$OUT/gpu_tests.log"; fi
  if (( ${#MISSED[@]} )); then note "gpu_check: not started before the deadline: ${MISSED[*]}"; rc=3; fi
  if (( ${#FAILED[@]} )); then note "gpu_check: FAILED stages: ${FAILED[*]}"; rc=1; fi
  if (( rc == 0 )); then note "gpu_check: all stages passed ($STAGES)"; fi
  if (( PACK )); then pack; fi
  exit $rc
}

# runs stage NAME in a subshell, so a failure ends the stage, not the check (unless it must)
stage() {
  local name=$1 t rc took why
  t=$(date +%s)
  if (( DEADLINE > 0 && $(left) < 30 )); then
    note "$name: not started, $(left) s left before the deadline"
    SUMMARY+=("$name not started,") MISSED+=("$name")
    return 0
  fi
  set +e
  (set -Eeuo pipefail; "stage_${name//-/_}")
  rc=$?
  set -e
  took=$(( $(date +%s) - t ))
  if (( rc == 0 )); then
    SUMMARY+=("$name passed in ${took}s,")
    return 0
  fi
  if (( rc == 124 )); then why="stopped at its time limit"; else why="exit $rc"; fi
  note "FAILED in stage \"$name\" ($why, after ${took}s); its log is in $OUT"
  SUMMARY+=("$name FAILED in ${took}s,") FAILED+=("$name")
  if (( ! KEEP_GOING )) || [[ $name == build ]]; then finish; fi
}

cd "$REPO"
: > "$OUT/progress.txt"
note "zinfjax GPU check: stages $STAGES$([[ $DRY == 1 ]] && echo ' (dry run)')$(
  (( DEADLINE )) && echo ", deadline ${DEADLINE}s")$( (( KEEP_GOING )) && echo ", keep going"), logs in $OUT"
for s in ${STAGES//,/ }; do stage "$s"; done
finish
