#!/usr/bin/env bash
# Build the kernels, run the GPU tests, memcheck on the small cases, then the benchmark.
# Used for the H200 figures in docs/performance.md; works on any CUDA machine with
# torch, cmake and nvcc. Results go to ${OUT:-./gpu-out}.
#   scripts/gpu_check.sh [tests|sanitize|memcheck-meta|sanitize-quick|bench|pages|prefill|generate|triton|breakdown|ab|trace|ncu|
#                         ncu-prefill|ncu-source|ncu-source-prefill|ncu-source-route|gather|compare|dca|all]...
# Modes run in this order whatever the order given; sanitize-quick stops after
# ${SANITIZE_QUICK_S:-240} s (memcheck runs each test 10-50x slower). GPU_CHECK_PACK=1 leaves
# everything in one archive, $OUT/gpu_check_logs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
what=${*:-all}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then  # test-only wheels carried to machines without package access
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
t0=$(date +%s)
# The TensorRT plugin and its harness when TensorRT headers are at hand (never committed: see
# plugins/trt/README.md for how to fetch them into third_party/).
trt_flags=()
TRT_HEADERS=${TRT_HEADERS:-third_party/TensorRT-v10.8.0}
if [ -f "$TRT_HEADERS/include/NvInfer.h" ]; then
  trt_flags=(-DDASH_BUILD_TRT_PLUGIN=ON -DDASH_BUILD_TESTS=ON -DTensorRT_ROOT="$TRT_HEADERS")
fi
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90a-real} \
  -DDASH_REQUIRE_CUDA=ON "${trt_flags[@]}" > "$OUT/build.log" 2>&1 && cmake --build build-gpu -j"$(nproc)" >> "$OUT/build.log" 2>&1
rc=$?; echo "build rc=$rc ($(( $(date +%s) - t0 )) s)"; [ $rc -eq 0 ] || { tail -40 "$OUT/build.log"; exit $rc; }
export DASH_TRT_LIBRARY=$PWD/build-gpu/plugins/libdash_trt_kernels.so
harness=$(find build-gpu -name libdash_trt_plugin_harness.so | head -1)
[ -n "$harness" ] && export DASH_TRT_HARNESS=$PWD/$harness
status=0
case " $what " in *" tests "*|*" all "*)
  wgc=$(find build-gpu -name dash_wgmma_check -type f | head -1)
  if [ -n "$wgc" ]; then "$wgc" 2>&1 | tee "$OUT/wgmma_check.log"; status=$(( status | ${PIPESTATUS[0]} )); fi
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_kernel_abi.py tests/test_ops.py \
    tests/test_runtime.py tests/test_fused.py "tests/test_custom_model.py::test_custom_model_on_the_cuda_kernels" \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  status=$(( status | ${PIPESTATUS[0]} ))
  # Separate process: on the H200 image the harness library crashed (SIGSEGV inside iostream
  # formatting in dash_harness_creator_info; see plugins/trt/README.md), which must not take
  # the kernel results down with it.
  if [ -n "${DASH_TRT_HARNESS:-}" ]; then
    python3 -X faulthandler -m pytest -q -p no:cacheprovider tests/test_trt_harness.py 2>&1 \
      | tee "$OUT/trt_harness.log" | tail -15
    status=$(( status | ${PIPESTATUS[0]} ))
  fi;;
esac
case " $what " in *" sanitize "*|*" all "*)
  # The caching allocator would hide out-of-bounds accesses inside its large blocks. Without
  # it, CUDA-graph capture fails (cudaMalloc while capturing), so the graph test is left out.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    -k "bad_block or unsupported or prompt_length-0-dtype2 or per_layer_lists-0-dtype1 or 2-8-2-64-dtype1 or prompt-128-8-2-dtype1" 2>&1 | tee "$OUT/memcheck.log" | tail -8
  status=$(( status | ${PIPESTATUS[0]} ));;
esac
case " $what " in *" pages "*|*" all "*)
  # Pages per second: Unlimited-OCR-2's published shape with dash-trt's, vLLM 0.34.0's and dense
  # attention (bench/bench_pages.py), after the GPU tests of the MoE's grouped GEMMs and the
  # batched tower. vLLM's DASH files travel as .vllm/vllm-0.34.0-dash.tar.xz (VLLM_DASH; never
  # committed: bench/vllm_peer.py says what it holds); without them the vllm path is left out.
  python3 -m pytest -q -p no:cacheprovider tests/test_unlimited_ocr2.py tests/test_vision_batched.py -k "gpu" \
    2>&1 | tee "$OUT/pages_tests.log" | tail -5
  status=$(( status | ${PIPESTATUS[0]} ))
  vllm_dash=${VLLM_DASH:-.vllm/vllm-0.34.0-dash.tar.xz}
  paths=${PAGES_PATHS:-dash,vllm,dense-fa3,dense}
  vllm_args=()
  if [ -e "$vllm_dash" ]; then vllm_args=(--vllm "$vllm_dash"); else paths=${paths//vllm,/}; paths=${paths%,vllm}; fi
  read -r -a pages_args <<< "${PAGES_ARGS:---parts --check}"
  python3 bench/bench_pages.py --paths "$paths" "${vllm_args[@]}" "${pages_args[@]}" \
    --json "$OUT/pages.json" --png "$OUT/pages.png" 2>&1 | tee "$OUT/pages.log"
  status=$(( status | ${PIPESTATUS[0]} ));;
esac
case " $what " in *" generate "*|*" all "*)
  # End to end: the serving runtime (the engine's step loop) beside the dense peer.
  python3 bench/bench_generate.py ${GENERATE_ARGS:-} --json "$OUT/generate.json" --png "$OUT/generate.png" 2>&1 \
    | tee "$OUT/generate.log"
  status=$(( status | ${PIPESTATUS[0]} ));;
esac
case " $what " in *" triton "*)
  # The real Triton server on the GPU (the nvidia-pytriton, tritonclient and python-rapidjson
  # wheels carried in .whl/): a KIND_GPU generation model, concurrent long-document requests,
  # every answer against offline generation. The backend stub's embedded Python finds dash_trt
  # through a .pth file in the interpreter's site-packages (it ignores PYTHONPATH).
  site=$(python3 -c "import site; print(site.getsitepackages()[0])")
  echo "$PWD" > "$site/dash_trt_checkout.pth"
  python3 -m dash_trt.triton.loadtest --device cuda --random-init "${TRITON_CONFIG:-export/configs/benchmark.json}" \
    --dtype float32 --kv-block-size 64 --num-blocks "${TRITON_BLOCKS:-4096}" --requests "${TRITON_REQUESTS:-32}" \
    --pages "${TRITON_PAGES:-2,6}" --images "${TRITON_IMAGES:-500,1300}" --max-new-tokens "${TRITON_NEW:-8,24}" \
    --prefill-chunk 2048 --max-batch-tokens 4096 --server-log "$OUT/tritonserver.log" 2>&1 | tee "$OUT/triton_gpu.log"
  status=$(( status | ${PIPESTATUS[0]} ));;
esac
case " $what " in *" memcheck-meta "*|*" all "*)
  # Random int32 metadata and caches (what TensorRT's build-time timing feeds a plugin): no
  # out-of-bounds access anywhere, under memcheck.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${MEMCHECK_META_S:-200}" compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -v -p no:cacheprovider tests/test_cuda.py -k arbitrary_metadata 2>&1 \
    | tee "$OUT/memcheck_meta.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Sanitizer|ERROR SUMMARY" | tail -24
  rc=${PIPESTATUS[0]}; [ "$rc" -eq 124 ] && echo "memcheck-meta: stopped after ${MEMCHECK_META_S:-200} s"
  status=$(( status | rc ));;
esac
case " $what " in *" bench "*|*" all "*)
  # BENCH_ARGS: bench_dash's options, e.g. "--shape published --decode-only --time-budget 300".
  read -r -a bench_args <<< "${BENCH_ARGS:-}"
  python3 bench/bench_dash.py "${bench_args[@]}" --json "$OUT/bench.json" --png "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"
  status=$(( status | ${PIPESTATUS[0]} ));;
esac
case " $what " in *" dca "*)
  # Dual Chunk Attention beside its peers (bench/bench_dca.py: the brute-force three-call
  # approach, dense attention, the reference); DCA_ARGS: its options, e.g. "--time-budget 300".
  # First the Triton kernels against the paged operator, compiled (tests/test_dca_kernels.py).
  python3 -m pytest -q -p no:cacheprovider tests/test_dca_kernels.py 2>&1 | tee "$OUT/dca_tests.log" | tail -8
  status=$(( status | ${PIPESTATUS[0]} ))
  read -r -a dca_args <<< "${DCA_ARGS:-}"
  python3 bench/bench_dca.py "${dca_args[@]}" --json "$OUT/dca.json" --png "$OUT/dca.png" 2>&1 | tee "$OUT/dca.log"
  status=$(( status | ${PIPESTATUS[0]} ));;
esac
case " $what " in *" prefill "*)
  # The prefill kernels: the benchmark's prefill cases with and without the query-major tiles
  # (and its page-correlated indexer cases), then each kernel's time at 64k, both ways.
  python3 bench/bench_dash.py --prefill-only --ab-tiles --ab-mma ${PREFILL_ARGS:-} --json "$OUT/bench_prefill.json" 2>&1 \
    | tee "$OUT/bench_prefill.log"
  status=$(( status | ${PIPESTATUS[0]} ))
  for tuning in "" "tile_share_min=-1" "warpgroup_mma=-1"; do
    echo "## tuning: ${tuning:-default}" | tee -a "$OUT/breakdown_prefill.log"
    python3 bench/breakdown.py prefill --tuning "$tuning" 2>&1 | tee -a "$OUT/breakdown_prefill.log"
    status=$(( status | ${PIPESTATUS[0]} ))
  done;;
esac
case " $what " in *" breakdown "*)
  python3 bench/breakdown.py decode prefill 2>&1 | tee "$OUT/breakdown.log"
  status=$(( status | ${PIPESTATUS[0]} ))
  for ctas in ${ATTEND_CTAS_SWEEP:-}; do  # split-K target sweep (decode attention)
    python3 bench/breakdown.py decode --tuning attend_ctas=$ctas 2>&1 | grep -E "^## |attend|combine" \
      | sed "s/^/[ctas=$ctas] /" | tee -a "$OUT/breakdown.log"
  done;;
esac
case " $what " in *" ab "*)
  # The decode-only benchmark once per setting of AB_SETTINGS (space-separated), an A/B in one
  # call. A setting is kernel knobs (dash_trt.attention.dash.cuda.Tuning: "front_writer=1 front_writer=2"), or a
  # second library, "lib=$PWD/build-base/plugins/libdash_trt_kernels.so", with build-base
  # configured from an older tree (`git archive <commit> CMakeLists.txt plugins` unpacked into a
  # git-ignored folder that travels with the call).
  for setting in ${AB_SETTINGS:-}; do
    echo "## $setting" | tee -a "$OUT/ab.log"
    case "$setting" in
      lib=*) DASH_TRT_LIBRARY=${setting#lib=} python3 bench/bench_dash.py --decode-only 2>&1 ;;
      *) python3 bench/bench_dash.py --decode-only --tuning "$setting" 2>&1 ;;
    esac | grep -E "^\| [0-9]+ x|streaming read" | tee -a "$OUT/ab.log"
    status=$(( status | ${PIPESTATUS[0]} ))
  done;;
esac
case " $what " in *" trace "*)
  # Per-CTA phase timestamps of a decode step (a second build with the DASH_TRACE marks).
  cmake -S . -B build-trace -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHS:-90} \
    -DDASH_REQUIRE_CUDA=ON -DDASH_TRACE=ON > "$OUT/build_trace.log" 2>&1 \
    && cmake --build build-trace -j"$(nproc)" --target dash_trt_kernels >> "$OUT/build_trace.log" 2>&1 \
    && DASH_TRT_LIBRARY=$PWD/build-trace/plugins/libdash_trt_kernels.so python3 bench/trace_step.py 2>&1 | tee "$OUT/trace.log"
  status=$(( status | ${PIPESTATUS[0]} ));;
esac
case " $what " in *" compare "*|*" all "*)
  # dash-compare with the CUDA kernels runner, on a file exported elsewhere (dash-export --demo
  # --out gpu-in/dash_demo.onnx; this machine may lack onnxscript). DASH_ONNX and
  # DASH_COMPARE_ARGS pick another export, e.g. a head-dim-64 model the kernels run:
  # DASH_ONNX=gpu-in/m64.onnx DASH_COMPARE_ARGS="--checkpoint gpu-in/m64.pt".
  onnx=${DASH_ONNX:-gpu-in/dash_demo.onnx}
  read -r -a cmp_args <<< "${DASH_COMPARE_ARGS:---demo}"
  if [ -f "$onnx" ]; then
    python3 -c "import onnxruntime, onnx; print('onnxruntime', onnxruntime.__version__, 'onnx', onnx.__version__)"
    python3 -m dash_trt.compare "$onnx" "${cmp_args[@]}" --no-cuda 2>&1 | tee "$OUT/compare_nocuda.log" | tail -4
    python3 -m dash_trt.compare "$onnx" "${cmp_args[@]}" --json "$OUT/compare.json" 2>&1 | tee "$OUT/compare.log" | tail -30
    status=$(( status | ${PIPESTATUS[0]} ))
  else
    echo "compare: no ONNX file at $onnx (export one with dash-export --demo --out $onnx)"
  fi;;
esac
case " $what " in *" ncu "*)
  # Why the decode step's kernels take as long as they do (one 32 x 128k step, eager).
  ncu --clock-control none --kernel-name regex:"write_kernel|summarize|route_split|attend_mma" -c 4 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --section MemoryWorkloadAnalysis python3 bench/profile_step.py decode 131072 > "$OUT/ncu_decode.log" 2>&1
  grep -E "^  [a-zA-Z_:<>, ]+\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Grid Size|L1/TEX Hit|L2 Hit|Stall|stall|cycles being stalled" \
    "$OUT/ncu_decode.log" | cut -c1-160 | head -80;;
esac
case " $what " in *" ncu-prefill "*)
  # Why a 64k prefill's kernels take as long as they do: the last block-major pass (tokens
  # 48k-64k at the default 16384 a pass: the block-major tiles, the query-major tiles, the combine) and the routing.
  sections=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats
            --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis)
  ncu --clock-control none --kernel-name regex:"block_attend_kernel|qm_attend_kernel|bm_combine_kernel" \
    --launch-skip 9 --launch-count 3 "${sections[@]}" python3 bench/profile_step.py prefill 65536 \
    > "$OUT/ncu_prefill.log" 2>&1
  ncu --clock-control none --kernel-name regex:"route_tile_kernel" --launch-count 1 "${sections[@]}" \
    python3 bench/profile_step.py prefill 65536 >> "$OUT/ncu_prefill.log" 2>&1
  grep -E "^  [a-zA-Z_:<>, ]+\(|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Block Limit|Registers Per|Grid Size|L1/TEX Hit|L2 Hit|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|One or More|No Eligible" \
    "$OUT/ncu_prefill.log" | cut -c1-150 | head -120;;
esac
case " $what " in *" ncu-source-prefill "*)
  # Where the prefill tiles' warps wait, and what they execute: sampled stall reasons and
  # executed instructions per SASS instruction, the last block-major pass of a 64k prefill (the
  # CSV kept, gzipped).
  ncu --clock-control none --kernel-name regex:"block_attend_kernel|qm_attend_kernel" --launch-skip 6 --launch-count 2 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy -f -o "$OUT/ncu_source_prefill" \
    python3 bench/profile_step.py prefill 65536 > "$OUT/ncu_source_prefill_run.log" 2>&1
  tail -3 "$OUT/ncu_source_prefill_run.log"
  if ncu -i "$OUT/ncu_source_prefill.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source_prefill.csv" \
      2> "$OUT/ncu_source_prefill.err"; then
    python3 bench/ncu_source_top.py "$OUT/ncu_source_prefill.csv" 40 | tee "$OUT/ncu_source_prefill_top.log"
    gzip -f "$OUT/ncu_source_prefill.csv"
  else
    head -5 "$OUT/ncu_source_prefill.err"
  fi
  ncu -i "$OUT/ncu_source_prefill.ncu-rep" --page details > "$OUT/ncu_prefill_details.log" 2>&1
  grep -E "^  [a-zA-Z_:<>, ]+\(|Duration|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Stall" \
    "$OUT/ncu_prefill_details.log" | cut -c1-150 | head -60;;
esac
case " $what " in *" ncu-source-route "*)
  # What the fused routing of a 64k prefill executes and where its warps wait: sampled stall
  # reasons and executed instructions per SASS instruction (the CSV kept, gzipped).
  ncu --clock-control none --kernel-name regex:"route_tile_kernel" --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy -f -o "$OUT/ncu_source_route" \
    python3 bench/profile_step.py prefill 65536 > "$OUT/ncu_source_route_run.log" 2>&1
  tail -3 "$OUT/ncu_source_route_run.log"
  if ncu -i "$OUT/ncu_source_route.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source_route.csv" \
      2> "$OUT/ncu_source_route.err"; then
    python3 bench/ncu_source_top.py "$OUT/ncu_source_route.csv" 40 | tee "$OUT/ncu_source_route_top.log"
    gzip -f "$OUT/ncu_source_route.csv"
  else
    head -5 "$OUT/ncu_source_route.err"
  fi
  ncu -i "$OUT/ncu_source_route.ncu-rep" --page details > "$OUT/ncu_route_details.log" 2>&1
  grep -E "Duration|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issue Slots Busy|Executed Ipc A|Warp Cycles Per Issued|Stall" \
    "$OUT/ncu_route_details.log" | cut -c1-150 | head -40;;
esac
case " $what " in *" ncu-source "*)
  # Where the routing and attention warps wait: sampled stall reasons per SASS instruction.
  ncu --clock-control none --kernel-name regex:"route_split|attend_mma" -c 2 --section SourceCounters \
    --section WarpStateStats -f -o "$OUT/ncu_source" python3 bench/profile_step.py decode 131072 > "$OUT/ncu_source_run.log" 2>&1
  tail -3 "$OUT/ncu_source_run.log"
  if ncu -i "$OUT/ncu_source.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source.csv" 2> "$OUT/ncu_source.err"; then
    python3 bench/ncu_source_top.py "$OUT/ncu_source.csv" 25
  else
    head -5 "$OUT/ncu_source.err"; ncu --help | grep -A2 -E "page|print-source" | head -20
  fi;;
esac
case " $what " in *" gather "*)
  # Read bandwidth of the decode attention's access pattern without its arithmetic.
  nvcc -O3 -std=c++17 -arch=sm_90 -o build-gpu/gather_bw bench/gather_bw.cu && build-gpu/gather_bw | tee "$OUT/gather.log"
  status=$(( status | ${PIPESTATUS[0]} ));;
esac
case " $what " in *" sanitize-quick "*)
  # Last, and bounded: the split routing's merge, both decode-only writer placements, the
  # block-major paths (with their query-major tiles). One line per test in the log, so a cut-off run still says how far it got.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZE_QUICK_S:-240}" compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest -v -p no:cacheprovider tests/test_cuda.py \
    -k "${SANITIZE_QUICK_K:-split_routing_over or prompt-128-8-2-dtype1 or decode_only_steps or (query_major_tiles and 128-8-2-dtype1)}" 2>&1 \
    | tee "$OUT/memcheck_quick.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Sanitizer" | tail -12
  rc=${PIPESTATUS[0]}; [ "$rc" -eq 124 ] && echo "memcheck quick: stopped after ${SANITIZE_QUICK_S:-240} s"
  status=$(( status | rc ));;
esac
if [ "${GPU_CHECK_PACK:-0}" = 1 ]; then  # one file back (the device tool returns at most 8)
  pack=$(mktemp) && tar czf "$pack" -C "$OUT" --exclude=gpu_check_logs.tgz . \
    && (cd "$OUT" && rm -f ./*.log ./*.json ./*.txt ./*.csv) && chmod 644 "$pack" && mv "$pack" "$OUT/gpu_check_logs.tgz" \
    || echo "packing the logs failed; they are left as they were"
fi
exit $status
