#!/usr/bin/env bash
# The benchmarks' GPU figures in one run, in priority order, each benchmark capped in time so a short
# lease still brings back the first ones:
#   OUT_DIR=DIR [ONLY="ladder latency"] bash scripts/gpu_figures.sh
# Steps: ladder (the course's rungs), latency (decode steps at batch 1-64 and TTFT, with and without the
# small-batch GEMVs, and the SmolLM2-135M shape), gemv (the decode step's linears, every candidate config
# swept), profile (the batch-1 decode step's kernels and the gaps between them, without and with the
# small-batch GEMVs, on by default), moe (the fused-MoE
# kernel by token count, both paths), spec (speculative decoding, n-gram and draft models); and, named in
# ONLY: throughput (the 256-request workload with the small-batch GEMVs, the default, and without them),
# fp8 (the FP8-cache decode sweep, bench_decode over FP8 and bf16
# caches, the 256-request workload with an FP8 cache against bf16, the decode call's stalls under ncu),
# moe_e2e (Qwen3-30B-A3B's shape on the 256-request workload, random weights drawn on the GPU, then its
# batch-64 decode step kernel by kernel),
# gemv_f32 (a float32 verify step's 5 rows at SmolLM2's shapes: the multiply-add tiles against the
# full-precision dot tiles).
# Each step writes its JSON/PNG and a log under OUT_DIR, and prints its exit code and the log's tail.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT_DIR=${OUT_DIR:-benchmarks/results/gpu_figures}
ONLY=${ONLY:-ladder latency gemv profile moe spec}  # and moe_e2e (an H200: 61 GB of weights)
mkdir -p "$OUT_DIR"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
MODEL=${MODEL:-$HOME/.cache/minivllm/random-qwen3-0.6b}  # bench_latency's own random checkpoint

step() {  # step NAME SECONDS command...: run it capped, log it, report
  local name=$1 limit=$2; shift 2
  local start; start=$(date +%s)
  timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  echo "[$name: exit $? in $(( $(date +%s) - start )) s] $*"
  tail -n 16 "$OUT_DIR/$name.log"
}

wants() { [[ " $ONLY " == *" $1 "* ]]; }
for name in $ONLY; do
  case $name in ladder|latency|gemv|gemv_f32|profile|moe|moe_e2e|spec|throughput|fp8) ;;
    *) echo "unknown step '$name' in ONLY (ladder latency gemv gemv_f32 profile moe moe_e2e spec throughput fp8)"; exit 2;; esac
done

"$PYTHON" -c "from minivllm.tools.make_model import make_model; make_model('qwen3-0.6b', '$MODEL', seed=0)" \
  > "$OUT_DIR/make_model.log" 2>&1 || { echo "make_model failed:"; tail "$OUT_DIR/make_model.log"; exit 1; }
if wants ladder; then
  # 16 requests: rungs 1-2 (the torch reference's loop over sequences) took 76 and 72 s on an H100, the
  # whole ladder 232 s (2026-12-07); 64 requests do not finish rung 1 in 240 s
  step ladder 300 "$PYTHON" -m benchmarks.bench_ladder --out-dir "$OUT_DIR" --model "$MODEL" --num-requests 16 \
    --max-len 384 --shared-prefix-len 128
fi
if wants latency; then
  step latency 130 "$PYTHON" -m benchmarks.bench_latency --out-dir "$OUT_DIR" --model "$MODEL"
  step latency_no_gemv 110 "$PYTHON" -m benchmarks.bench_latency --out-dir "$OUT_DIR" --model "$MODEL" --label no_gemv \
    --engine-args '{"small_batch_gemv": false}'
  step latency_smollm2 60 "$PYTHON" -m benchmarks.bench_latency --out-dir "$OUT_DIR" --preset smollm2-135m \
    --label smollm2 --batches 1 4 --ttft-lens 128 1024
fi
if wants gemv; then
  step gemv 170 "$PYTHON" -m benchmarks.bench_gemv --out-dir "$OUT_DIR" --sweep --batches 1,4,16
fi
if wants gemv_f32; then
  mkdir -p "$OUT_DIR/gemv_f32"
  step gemv_f32 150 "$PYTHON" -m benchmarks.bench_gemv --out-dir "$OUT_DIR/gemv_f32" --model smollm2-135m --dtype float32 \
    --batches 1,5 --sweep --sweep-dot both --sweep-tiles 4x128x4,4x256x4,16x64x4,16x128x4,32x64x4 --sweep-splits 1,2
fi
if wants profile; then
  step profile 60 "$PYTHON" -m benchmarks.profile_decode --out-dir "$OUT_DIR" --model "$MODEL" --batch 1 --context 1024
  step profile_no_gemv 60 "$PYTHON" -m benchmarks.profile_decode --out-dir "$OUT_DIR" --model "$MODEL" --batch 1 \
    --context 1024 --label no_gemv --engine-args '{"small_batch_gemv": false}'
  rm -f "$OUT_DIR"/profile_decode*_trace.json  # the chrome traces: large, and the JSON has the tables
fi
if wants moe; then
  step moe 100 "$PYTHON" -m benchmarks.bench_moe --out-dir "$OUT_DIR" --batches 1,2,4,8,16,64,256,4096 \
    --naive-max-m 16 --rep-ms 50
fi
if wants moe_e2e; then  # Qwen3-30B-A3B's shape end to end: 61 GB of weights drawn on the GPU (load_format dummy)
  step moe_e2e 240 "$PYTHON" -m benchmarks.bench_throughput --out-dir "$OUT_DIR" --preset qwen3-30b-a3b \
    --load-format dummy --skip-hf
  step moe_profile 150 "$PYTHON" -m benchmarks.profile_decode --out-dir "$OUT_DIR" --preset qwen3-30b-a3b \
    --load-format dummy --batch 64 --context 1024 --steps 10 --label moe_b64  # where the step's time goes
  rm -f "$OUT_DIR"/profile_decode_moe_b64_*trace.json
fi
if wants spec; then
  step spec 200 "$PYTHON" -m benchmarks.bench_spec_decode --out-dir "$OUT_DIR" --model "$MODEL" --batches 1 8 64 \
    --ks 4 --draft-model --trace --sampler --profile-kernels
fi
if wants throughput; then  # each run writes bench_throughput.json: one folder per engine
  mkdir -p "$OUT_DIR/throughput_default" "$OUT_DIR/throughput_no_gemv"
  step throughput_default 150 "$PYTHON" -m benchmarks.bench_throughput --out-dir "$OUT_DIR/throughput_default" \
    --model "$MODEL" --skip-hf
  step throughput_no_gemv 150 "$PYTHON" -m benchmarks.bench_throughput --out-dir "$OUT_DIR/throughput_no_gemv" \
    --model "$MODEL" --skip-hf --engine-args '{"small_batch_gemv": false}'
fi
if wants fp8; then
  step fp8_tune 240 "$PYTHON" benchmarks/tune_kernels.py --out "$OUT_DIR/tune_decode_fp8" --skip-tests --only decode-fp8
  step fp8_decode 120 "$PYTHON" -m benchmarks.bench_decode --out-dir "$OUT_DIR" --kv-cache-dtype auto fp8
  step fp8_throughput 200 "$PYTHON" -m benchmarks.bench_throughput --out-dir "$OUT_DIR" --model "$MODEL" --skip-hf \
    --kv-cache-dtype fp8 --compare-unquantized
  # what the FP8 call waits on (Nsight Compute, if the machine has ncu): stall reasons beside bf16's
  command -v ncu > /dev/null && step fp8_ncu 240 "$PYTHON" -m benchmarks.probe_decode_bound --out-dir "$OUT_DIR" \
    --shapes 64x4096 --ncu
fi
