#!/usr/bin/env bash
# The GPU check: the default run on 1 GPU in float32, float16 and bfloat16, then on every GPU (or, where the
# machine has one, on 2 logical GPUs carved from it) with each of the nccl and hierarchical-copy all-reduces.
# Prints one table: images/s of `fit`, test accuracy of the restored checkpoint, and TensorFlow's peak GPU
# memory per GPU (results.json's peak_gpu_memory_mb), with each run's status.
#
#   bash benchmarks/gpu_check.sh --idx-dir DIR      # the four MNIST IDX files, prepared once into the output dir
#   bash benchmarks/gpu_check.sh --data-dir DIR     # a prepared tfds data dir
#   bash benchmarks/gpu_check.sh --dry-run --data-dir DIR   # print what would run, run nothing (no GPU needed)
#
# Before anything else it makes the entrypoint's GPU check (machinery/gpu_box.py): GPUs that TensorFlow cannot use stop it.
# Options: --epochs N (3), --output-dir DIR (a new temporary folder; kept, with each run's log),
# --run-timeout SECONDS (100 a run, so that five runs and the prepare stay under 10 minutes).
# A run that fails or times out is a row of the table saying so; the check goes on with the next.
set -euo pipefail
cd "$(dirname "$0")/.."

EPOCHS=3
RUN_TIMEOUT=100
LOGICAL_GPU_MB=4096  # each of the 2 logical GPUs carved from one; MNIST needs far less
DATA_DIR=""
IDX_DIR=""
OUTPUT_DIR=""
DRY_RUN=0

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
fail() { echo "error: $1" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --data-dir) DATA_DIR="${2:?--data-dir needs a folder}"; shift 2 ;;
    --idx-dir) IDX_DIR="${2:?--idx-dir needs a folder}"; shift 2 ;;
    --epochs) EPOCHS="${2:?--epochs needs a number}"; shift 2 ;;
    --output-dir) OUTPUT_DIR="${2:?--output-dir needs a folder}"; shift 2 ;;
    --run-timeout) RUN_TIMEOUT="${2:?--run-timeout needs seconds}"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) fail "unknown option $1; see bash $0 --help" ;;
  esac
done
[ -n "$DATA_DIR$IDX_DIR" ] || fail "give --data-dir (a prepared tfds dir) or --idx-dir (the four MNIST IDX files)"
[ -z "$DATA_DIR" ] || [ -z "$IDX_DIR" ] || fail "give --data-dir or --idx-dir, not both"
[[ "$EPOCHS" =~ ^[1-9][0-9]*$ ]] || fail "--epochs must be a whole number of at least 1, got $EPOCHS"
[[ "$RUN_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || fail "--run-timeout must be whole seconds, got $RUN_TIMEOUT"

if command -v nvidia-smi >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU " || true)
else
  GPUS=0
fi
if [ "$DRY_RUN" = 0 ] && [ "$GPUS" -lt 1 ]; then
  fail "nvidia-smi lists no GPU here; run this on a machine with one (or pass --dry-run to see the commands)"
fi
# The entrypoint's own check: GPUs that TensorFlow cannot use (its CUDA 12 libraries missing) stop the check here,
# with the entrypoint's one line, instead of four failed rows.
if [ "$DRY_RUN" = 0 ]; then
  python -m machinery.gpu_box > /dev/null || exit 2
fi

# Two logical GPUs carved from the first physical one, set before the entrypoint starts TensorFlow's runtime.
CARVE_TWO='import sys
import tensorflow as tf
gpu = tf.config.list_physical_devices("GPU")[0]
tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=int(sys.argv[1]))] * 2)
sys.argv = ["train_mnist_mirrored.py"] + sys.argv[2:]
import train_mnist_mirrored
sys.exit(train_mnist_mirrored.main(sys.argv[1:]))'

# name | how to start the entrypoint | its flags
RUNS=("1 GPU|python train_mnist_mirrored.py|--devices /gpu:0"
      "1 GPU, --mixed-precision|python train_mnist_mirrored.py|--devices /gpu:0 --mixed-precision"
      "1 GPU, --mixed-precision bfloat16|python train_mnist_mirrored.py|--devices /gpu:0 --mixed-precision bfloat16")
if [ "$GPUS" -ge 2 ]; then
  ALL="all $GPUS GPUs"
  START="python train_mnist_mirrored.py"
  # Named, so that a machine whose TensorFlow sees fewer GPUs than nvidia-smi fails the row instead of training elsewhere.
  DEVICES="--devices $(seq -s, -f '/gpu:%g' 0 $((GPUS - 1)))"
  RUNS+=("$ALL, nccl|$START|$DEVICES --cross-device-ops nccl"
         "$ALL, hierarchical-copy|$START|$DEVICES --cross-device-ops hierarchical-copy")
else
  ALL="2 logical GPUs on one"
  START="python -c CARVE_TWO $LOGICAL_GPU_MB"
  DEVICES="--devices /gpu:0,/gpu:1"
  RUNS+=("$ALL, nccl|$START|$DEVICES --cross-device-ops nccl"
         "$ALL, hierarchical-copy|$START|$DEVICES --cross-device-ops hierarchical-copy")
fi

if [ -z "$OUTPUT_DIR" ]; then
  if [ "$DRY_RUN" = 1 ]; then OUTPUT_DIR="<a new temporary folder>"; else OUTPUT_DIR=$(mktemp -d -t mnist-gpu-check-XXXXXX); fi
fi
if [ -n "$IDX_DIR" ]; then
  PREPARE=(python prepare_mnist.py --idx-dir "$IDX_DIR" --data-dir "$OUTPUT_DIR/tfds")
  DATA_DIR="$OUTPUT_DIR/tfds"
fi

if [ "$DRY_RUN" = 1 ]; then
  echo "dry run: $GPUS GPU(s) listed by nvidia-smi here; with fewer than 2 the last two runs use 2 logical GPUs"
  [ -z "$IDX_DIR" ] || echo "${PREPARE[*]}"
  for run in "${RUNS[@]}"; do
    IFS="|" read -r name start flags <<< "$run"
    echo "[$name] timeout $RUN_TIMEOUT $start --data-dir $DATA_DIR --output-dir $OUTPUT_DIR/<run> --epochs $EPOCHS --overwrite $flags"
  done
  exit 0
fi

START_TIME=$SECONDS
mkdir -p "$OUTPUT_DIR"
[ -z "$IDX_DIR" ] || "${PREPARE[@]}" > "$OUTPUT_DIR/prepare.log" 2>&1 || fail "preparing the data failed; see $OUTPUT_DIR/prepare.log"
nvidia-smi -L | tee "$OUTPUT_DIR/gpus.txt"

ROWS="$OUTPUT_DIR/rows.tsv"
: > "$ROWS"
index=0
for run in "${RUNS[@]}"; do
  IFS="|" read -r name start flags <<< "$run"
  index=$((index + 1))
  out="$OUTPUT_DIR/run$index"
  echo "[$name] running (log: $out.log)"
  read -r -a command <<< "$start"
  [ "${command[1]:-}" != "-c" ] || command[2]="$CARVE_TWO"
  read -r -a extra <<< "$flags"
  status=0
  timeout "$RUN_TIMEOUT" "${command[@]}" --data-dir "$DATA_DIR" --output-dir "$out" --epochs "$EPOCHS" --overwrite \
    "${extra[@]}" > "$out.log" 2>&1 || status=$?
  printf '%s\t%s\t%s\n' "$name" "$status" "$out" >> "$ROWS"
done

python - "$ROWS" <<'EOF'
import json, os, sys

print("\n| run | replicas | global batch | images/s | test accuracy | peak GPU memory (MB, per GPU) | status |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for line in open(sys.argv[1]):
    name, status, out = line.rstrip("\n").split("\t")
    path = os.path.join(out, "results.json")
    if status == "0" and os.path.exists(path):
        r = json.load(open(path))
        memory = ", ".join(f"{d} {mb:,.0f}" for d, mb in (r.get("peak_gpu_memory_mb") or {}).items()) or "none"
        print(f"| {name} | {r['replicas']} | {r['global_batch_size']} | {r['train_images_per_s']:,.0f} | "
              f"{r['eval_accuracy_checkpoint']:.4f} | {memory} | ok |")
    else:
        lines = [l.strip() for l in open(out + ".log", errors="replace") if l.strip()]
        why = "timed out" if status == "124" else f"exit {status}: {lines[-1][:160] if lines else 'no output'}"
        print(f"| {name} | | | | | | {why.replace('|', '/')} |")
EOF
echo
echo "$EPOCHS epochs a run; $((SECONDS - START_TIME)) s in all; logs and outputs in $OUTPUT_DIR"
