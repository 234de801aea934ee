#!/usr/bin/env bash
# The whole GPU check of zinfjax on a bare GPU machine with no network, in one command:
#
#   scripts/gpu_check.sh OUT [STAGES]      STAGES: comma-separated, default all of
#                                          env,build,gpu-tests,bench,cpu-suite; also `ckpt`
#                                          (checkpoint save/restore per tier on the GPU, about
#                                          3 minutes: run it as its own call, after `build`) and
#                                          `largest` (the largest GPT per placement, 3 steps each;
#                                          LARGEST="nvme" or "mixed" picks placements: one per call fits;
#                                          LARGEST_ARGS adds flags, e.g. "--bf16-moments --hidden 5120")
#                                          and `profile` (a jax.profiler trace of the bench GPT,
#                                          all on device and on pinned host, and the top kernels
#                                          by time as text: profile_device.txt, profile_pinned_host.txt)
#                                          and `peer` (DeepSpeed ZeRO-3 offload and zinfjax on the same
#                                          GPT and shapes, one table: peer_table.txt; deepspeed comes
#                                          from the bundle scripts/peer_bundle.sh makes in build/peer
#                                          (carry it); PEER_SIDES="ours" or "deepspeed" runs one side
#                                          per call, PEER_PLACEMENTS a subset of device,cpu,nvme)
#                                          and `copy-stream` (the host-pipeline and NVMe steps with
#                                          grads leaving the device on XLA's stream, then through
#                                          the copy stream: ZINFJAX_COPY_STREAM=0/1, copy_stream_*.log)
#   scripts/gpu_check.sh OUT --dry-run     on a machine without a GPU: checks that every
#                                          stage's commands exist and run (GPU tests skipped,
#                                          benchmarks at tiny sizes), builds nothing
#
# Each stage writes its log under OUT (env.txt, build.log, gpu_tests.log, bench_gpu.log,
# bench_gpu.json, bench_checkpoint.log, largest_gpt.log, peer_table.txt, cpu_suite.log) and a line to OUT/progress.txt. The first failure stops the
# check and prints the stage it reached and where its log is.
set -Eeuo pipefail

OUT=${1:?usage: scripts/gpu_check.sh OUT [STAGES|--dry-run]}
STAGES=${2:-env,build,gpu-tests,bench,cpu-suite}
DRY=0
if [[ "$STAGES" == "--dry-run" ]]; then
  DRY=1
  STAGES=env,gpu-tests,bench,ckpt,largest,profile,peer,copy-stream
fi
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# grow GPU memory on demand: the tests start workers beside the pytest process, and peaks are read
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
if [[ -z "${CUDAToolkit_ROOT:-}" && -d /usr/local/cuda ]]; then export CUDAToolkit_ROOT=/usr/local/cuda; fi
STAGE=start
T0=$(date +%s)

note() { echo "[gpu_check $(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/progress.txt"; }
trap 'rc=$?; if (( BASH_SUBSHELL == 0 )); then note "FAILED in stage \"$STAGE\" (exit $rc); its log is in $OUT"; fi; exit 1' ERR
want() { [[ ",$STAGES," == *",$1,"* ]]; }
# runs a stage's command with a time limit, its output to the log and the console
run() {
  local log=$1 limit=$2
  shift 2
  set -o pipefail
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$log"
}

cd "$REPO"
: > "$OUT/progress.txt"
note "zinfjax GPU check: stages $STAGES$([[ $DRY == 1 ]] && echo ' (dry run)'), logs in $OUT"

if want env; then
  STAGE=env
  {
    date -u
    uname -a
    nvidia-smi || echo "nvidia-smi: not available"
    nproc; free -g; df -h "$REPO" /dev/shm || true
    $PY --version
    (cd /tmp && $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())")
    $PY -m pip list 2>/dev/null | grep -iE "^(jax|flax|optax|orbax|tensorstore|pybind11|scikit-build|torch|cupy|pytest)" || true
    command -v nvcc && nvcc --version | tail -2 || echo "nvcc: not found"
    command -v fio || echo "fio: not found (the disk ceiling falls back to dd)"
  } > "$OUT/env.txt" 2>&1
  note "env: $(grep -m1 -E '^\[|Cuda|cpu' "$OUT/env.txt" | head -c 200)"
fi

if want build; then
  STAGE=build
  run build.log 480 $PY -m pip install --no-deps --no-build-isolation -v "$REPO"
  grep -q "building CUDA handlers" "$OUT/build.log" || { note "the CUDA toolkit was not found: no CUDA handlers built"; false; }
  (cd /tmp && $PY -c "from zinfjax import _engine_cuda; n = _engine_cuda.device_count(); print('CUDA devices:', n); assert n >= 1")
  note "build: zinfjax installed with its CUDA handlers"
fi

if want gpu-tests; then
  STAGE=gpu-tests
  if [[ $DRY == 0 ]]; then
    (cd /tmp && $PY -c "import jax; assert jax.devices('gpu'), 'jax sees no GPU'")
  fi
  per_test=()  # a hang fails its test, not the whole check
  if $PY -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout 240); fi
  run gpu_tests.log 450 $PY -P -m pytest -q -p no:cacheprovider tests/gpu -ra "${per_test[@]}"
  if [[ $DRY == 0 ]] && grep -qE "[0-9]+ skipped" "$OUT/gpu_tests.log"; then
    note "GPU tests were skipped on a GPU machine: see gpu_tests.log"
    false
  fi
  if [[ $DRY == 1 ]]; then
    grep -q "needs a CUDA GPU" "$OUT/gpu_tests.log" || { note "GPU tests were not skipped with their reason"; false; }
  fi
  note "gpu-tests: $(tail -1 "$OUT/gpu_tests.log")"
fi

if want bench; then
  STAGE=bench
  if [[ $DRY == 1 ]]; then
    run bench_gpu.log 600 $PY scripts/bench_gpu.py --out "$OUT" --tiny
  else
    run bench_gpu.log 600 $PY scripts/bench_gpu.py --out "$OUT"
  fi
  note "bench: table in bench_gpu.log, numbers in bench_gpu.json"
fi

if want copy-stream; then
  STAGE=copy-stream
  for mode in 0 1; do
    if [[ $DRY == 1 ]]; then sizes=(--tiny --nvme-tokens 64); else sizes=(--tokens 16384); fi
    ZINFJAX_COPY_STREAM=$mode run "copy_stream_$mode.log" 280 $PY scripts/bench_gpu.py \
      --out "$OUT/copy_stream_$mode" --sections steps --placements device,pipeline-under,nvme "${sizes[@]}"
  done
  note "copy-stream: copy_stream_0.log (XLA's stream), copy_stream_1.log (the copy stream)"
fi

if want profile; then
  STAGE=profile
  for where in device pinned_host; do
    extra=()
    if [[ $DRY == 1 ]]; then extra=(--tiny); fi
    (cd /tmp && run "profile_$where.txt" 280 $PY "$REPO/scripts/profile_step.py" \
       --out "$OUT/profile_$where" --offload "$where" "${extra[@]}")
    rm -rf "$OUT/profile_$where/nvme"
  done
  note "profile: top kernels in profile_device.txt and profile_pinned_host.txt, traces under profile_*/trace"
fi

if want ckpt; then
  STAGE=ckpt
  CKPT_DIR=${CKPT_DIR:-$(mktemp -d /tmp/zinfjax-ckpt-XXXX)}  # on the machine's disk, not in OUT
  if [[ $DRY == 1 ]]; then
    size=(--layers 2 --hidden 64 --heads 2 --rounds 1 --probe $((64 << 20)))
  else  # a checkpoint of 2.7 GB (226M params), restored through the staging regions
    size=(--layers 32 --hidden 768 --heads 12 --rounds 3)
  fi
  (cd /tmp && run bench_checkpoint.log 420 $PY "$REPO/scripts/bench_checkpoint.py" --devices 1 \
     --folder "$CKPT_DIR" "${size[@]}") || { rm -rf "$CKPT_DIR"; false; }
  rm -rf "$CKPT_DIR"
  note "ckpt: table in bench_checkpoint.log"
fi

if want largest; then
  STAGE=largest
  BIG_DIR=${BIG_DIR:-$(mktemp -d /tmp/zinfjax-largest-XXXX)}  # the swap store, on the machine's disk
  if [[ $DRY == 1 ]]; then
    size=(--hidden 128 --heads 4 --seq-len 64 --batch-size 4 --devices 2 --hbm-gib 0.02
          --ram-gib 0.03 --disk-gib 0.05 --pinned-budget 64)
  else
    size=()
  fi
  # LARGEST_ARGS: more largest_gpt.py flags, e.g. "--bf16-moments --hidden 5120 --heads 40"
  (cd /tmp && run largest_gpt.log 590 $PY "$REPO/scripts/largest_gpt.py" --out "$OUT/largest" \
     --nvme-path "$BIG_DIR" --placements ${LARGEST:-device pinned_host nvme} "${size[@]}" \
     ${LARGEST_ARGS:-}) \
     || { rm -rf "$BIG_DIR"; false; }
  rm -rf "$BIG_DIR"
  note "largest: table in largest_gpt.log, every run in largest/largest_gpt.json"
fi

if want peer; then
  STAGE=peer
  PEER_DIR=${PEER_DIR:-$REPO/build/peer}
  PEER_SIDES=${PEER_SIDES:-ours,deepspeed}
  if [[ -d "$PEER_DIR/libaio" ]]; then  # DeepSpeed's NVMe offload builds and links against -laio
    export CPATH="$PEER_DIR/libaio/include${CPATH:+:$CPATH}" \
           LIBRARY_PATH="$PEER_DIR/libaio/lib${LIBRARY_PATH:+:$LIBRARY_PATH}" \
           LD_LIBRARY_PATH="$PEER_DIR/libaio/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
           CFLAGS="-I$PEER_DIR/libaio/include" LDFLAGS="-L$PEER_DIR/libaio/lib"
  fi
  if [[ $DRY == 1 ]]; then
    PEER_PLACEMENTS=${PEER_PLACEMENTS:-device,cpu}
    ours_size=(--tiny) peer_size=(--dry-run)
  else
    PEER_PLACEMENTS=${PEER_PLACEMENTS:-device,cpu,nvme}
    ours_size=(--tokens 16384 --nvme-tokens 16384) peer_size=(--tokens 16384)
  fi
  if [[ ",$PEER_SIDES," == *",ours,"* ]]; then
    for placement in ${PEER_PLACEMENTS//,/ }; do  # one process per placement: its own peaks
      case $placement in device) keys="device";; cpu) keys="pinned pipeline-under";; nvme) keys="nvme";; esac
      for key in $keys; do
        (cd /tmp && run "peer_ours_$key.log" 300 $PY "$REPO/scripts/bench_gpu.py" --out "$OUT/peer_ours_$key" \
           --sections matmul,steps --placements "$key" "${ours_size[@]}")
      done
    done
  fi
  if [[ ",$PEER_SIDES," == *",deepspeed,"* ]]; then
    if ! (cd /tmp && $PY -c "import deepspeed" 2>/dev/null) && [[ -d "$PEER_DIR/wheels" ]]; then
      $PY -m pip install -q --no-index --find-links "$PEER_DIR/wheels" deepspeed > "$OUT/peer_install.log" 2>&1
    fi
    if (cd /tmp && $PY -c "import deepspeed, torch" 2>/dev/null); then
      run peer_deepspeed.log 560 $PY "$REPO/scripts/peer_deepspeed.py" --out "$OUT" \
        --placements "$PEER_PLACEMENTS" "${peer_size[@]}"
    elif [[ $DRY == 1 ]]; then
      note "peer: torch or deepspeed is not installed here: the DeepSpeed side is not run"
    else
      note "peer: no deepspeed and no bundle in $PEER_DIR: run scripts/peer_bundle.sh here and carry build/peer"
      false
    fi
  fi
  if [[ -f "$OUT/peer_deepspeed.json" ]] && compgen -G "$OUT/peer_ours_*/bench_gpu.json" > /dev/null; then
    $PY "$REPO/scripts/peer_deepspeed.py" --compare "$OUT/peer_deepspeed.json" \
      --ours "$OUT"/peer_ours_*/bench_gpu.json | tee "$OUT/peer_table.txt"
  fi
  note "peer: $(ls "$OUT"/peer_table.txt "$OUT"/peer_deepspeed.json "$OUT"/peer_ours_*/bench_gpu.json 2>/dev/null | xargs -n1 basename | sort -u | tr '\n' ' ')"
fi

if want cpu-suite; then
  STAGE=cpu-suite
  workers=()
  if $PY -c "import xdist" 2>/dev/null; then workers=(-n "$(( $(nproc) > 8 ? 8 : $(nproc) ))" --dist loadfile); fi
  JAX_PLATFORMS=cpu run cpu_suite.log 900 $PY -P -m pytest -q -p no:cacheprovider --ignore=tests/gpu "${workers[@]}"
  note "cpu-suite: $(tail -1 "$OUT/cpu_suite.log")"
fi

STAGE=done
note "gpu_check: all stages passed ($STAGES)"
