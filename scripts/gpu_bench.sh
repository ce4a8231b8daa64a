#!/usr/bin/env bash
# Reruns the GPU measurements behind the current tables of docs/benchmarks.md on one CUDA machine, one
# step per mode given (a failing step is logged and the next one still runs). Usage:
#   OUT=/path/to/results bash scripts/gpu_bench.sh MODE [MODE ...]
# smoke: every benchmark on the tiny preset (catches device bugs in seconds); suite: the whole pytest suite;
# bench, batch_invariance, card_tests, card_waterfall, card_dialects, card_before, card_capacity, card_bench, serve_ragged_graphs,
# setup, stage0, stage2, slope, wire, video, soak: the minicpmo45 figures (random weights), each fits one 10-minute device call.
# The A/Bs and probes of earlier rounds (docs/results/HISTORY.md) are modes of scripts/probes/gpu_probes.sh.
# Every step is a `duplexcache bench BENCHMARK` command (run as `python3 -m duplexcache.cli`, so no install is needed).
# Needs torch with CUDA, triton, numpy, pyyaml, safetensors, pydantic, tqdm, matplotlib; the serve modes also
# fastapi, uvicorn, websockets, prometheus-client, httpx.
. "$(dirname "$0")/gpu_bench_lib.sh"

for mode in "${@:-smoke}"; do
case "$mode" in
  smoke)
    # A fixed 512 MiB budget (a plan of ~50 tiny sessions): tiny's auto budget on an 80 GB card plans ~10000,
    # and the warm-up of such a plan (every graph bucket up to the caps: 510 graphs) took 64 s per engine on an
    # H100 (2026-12-06), so each 120 s smoke step timed out. With a cold Triton cache smoke_ticks compiles the ragged
    # kernels (36 s on an H100 since the split count is a runtime argument; 110 s before)
    small="--memory-budget 512MiB"
    step smoke_bench 120 python3 -m duplexcache.cli bench memory --preset tiny --device cuda --sessions 1,2 $small --out "$out/smoke_bench"
    step smoke_ticks 120 python3 -m duplexcache.cli bench ticks --preset tiny --device cuda --sessions 1,2 --ticks 2 $small --out "$out/smoke_ticks"
    # the fp8 KV pools through warm-up, the decode graphs and the in-kernel dequantization
    step smoke_ticks_fp8 120 python3 -m duplexcache.cli bench ticks --preset tiny --device cuda --sessions 1,2 --ticks 2 --kv-cache-dtype fp8_e4m3 $small --out "$out/smoke_ticks_fp8"
    # the eager reference of engine.cuda_graphs (on by default): decode and ragged steps, encoder and vocoder eager
    step smoke_ticks_eager 120 python3 -m duplexcache.cli bench ticks --preset tiny --device cuda --sessions 1,2 --ticks 2 --cuda-graphs off $small --out "$out/smoke_ticks_eager"
    # camera frames (issue 47): every session a video session, the vision stage on the device
    step smoke_ticks_video 120 python3 -m duplexcache.cli bench ticks --preset tiny --device cuda --sessions 1,2 --ticks 2 --video-share 1 $small --out "$out/smoke_ticks_video"
    step smoke_setup 120 python3 -m duplexcache.cli bench setup --preset tiny --device cuda --sessions 3 --repeats 1 --out "$out/smoke_setup"
    serve_conversation smoke_serve duplexcache/configs/tiny.yaml 2 16 "engine.memory_budget=512MiB"   # 16 s: every caller reaches its first reply
    step gpu_tests 240 python3 -m pytest -q -x tests/cfm/test_graphs.py tests/cfm/test_dit_norms.py tests/kv/test_paged_attention.py tests/kv/test_decode_graphs.py tests/models/test_audio_encoder_graphs.py tests/runtime/test_warmup.py -p no:cacheprovider ;;
  suite)  # issue 14: the whole test suite on the GPU machine (CUDA tests run, interpreter tests skip; -q comes from pyproject).
    # SUITE_WORKERS (default 8); each worker's torch gets nproc / workers threads: at 12 workers with torch on all 16
    # cores a tiny CPU engine's tick took 21-27 s and the real-time server tests failed; 8 workers of 2 threads: 1226
    # passed in 163 s (H100, 2026-12-07). The SDK and reference tests need minicpmo-utils, openai and openbmb-realtime:
    # carry the wheels scripts/device_wheels.sh downloads (without them 6 files error)
    workers=${SUITE_WORKERS:-8}
    OMP_NUM_THREADS=$(( $(nproc) / workers > 0 ? $(nproc) / workers : 1 )) \
      step suite 420 python3 -m pytest -rs -n "$workers" --dist loadfile --timeout 300 -p no:cacheprovider tests ;;
  bench)  # the current "Equality on the GPU" table: memory per session A/B per switch at 1..16 sessions,
    # 1024-token Talker turns so 16 fit beside the always-speaking bench policy (~5 min on an H100)
    step bench 560 python3 -m duplexcache.cli bench memory --preset minicpmo45 --device cuda --sessions 1,2,4,8,16 --talker-turn-tokens 1024 --memory-budget 80GiB --no-waterfall --out "$out/bench" ;;
  setup)  # issue 4: setup time / private bytes of later sessions, context cache x shared anchors
    step session_setup 120 python3 -m duplexcache.cli bench setup --preset minicpmo45 --device cuda --sessions 4 --repeats 2 --out "$out/session_setup" ;;
  card_tests)  # issue 43: the card waterfall sums to mem_get_info's total, slack <= 1 GiB after warm-up (tiny on
    # CUDA, expandable segments as serve sets them), and the card-filling tests (~2 min)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step card_tests 300 python3 -m pytest -q -x \
      tests/runtime/test_card_waterfall.py tests/runtime/test_card_fill.py -p no:cacheprovider ;;
  card_waterfall)  # issue 43 after: a fresh server on examples/minicpmo45-shared.yaml (auto budget, measured activation
    # reserve, expandable segments, reply-policy Talker turns), 40 callers: more than it admits. The server log has
    # the waterfall ("card waterfall on cuda:0", one line per part, then "admitted / floor-limited = X"); the
    # bench's report the admitted count; card_waterfall_metrics.txt the duplexcache_device_bytes gauges (~5 min)
    SERVE_READY_S=420 serve_conversation card_waterfall examples/minicpmo45-shared.yaml 40 60
    grep -E 'card waterfall|cumulative|parts sum|admitted / floor-limited|re-plan|activation peak|engine ready' \
      "$out/card_waterfall_server.log" | tail -n 40 ;;
  card_before)  # issue 43 before, same server and callers with what of the issue can still be turned off: the fixed
    # 8 GiB reserve and 0.9 x free (engine.activation_from_warmup false), no expandable segments (the environment's
    # PYTORCH_CUDA_ALLOC_CONF wins). Whole Talker turns cannot be asked for since engine.talker_turn_from_policy was
    # retired (issue 44), so this is not the whole before row of docs/results/HISTORY.md (its waterfall is logged too) (~5 min)
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False SERVE_READY_S=420 serve_conversation card_before \
      examples/minicpmo45-shared.yaml 40 60 "engine.activation_from_warmup=false"
    grep -E 'card waterfall|cumulative|parts sum|admitted / floor-limited|engine ready' "$out/card_before_server.log" | tail -n 40 ;;
  card_dialects)  # issues 43 + 45: card_waterfall's server and 40 callers, half of them on each dialect (what the card
    # admits, the waterfall), then on the same server as many callers as that admitted, half on each dialect: every
    # caller should get audio, 0 late ticks (~6 min; CARD_SECONDS: each load's length, default 60)
    SERVE_READY_S=420 SERVE_THEN_ADMITTED=1 SERVE_EXTRA="--minicpmo-share 0.5 ${SERVE_EXTRA:-}" \
      serve_conversation card_dialects examples/minicpmo45-shared.yaml 40 "${CARD_SECONDS:-60}"
    grep -E 'card waterfall|cumulative|parts sum|admitted / floor-limited|re-plan|activation peak|engine ready|capturing' \
      "$out/card_dialects_server.log" | tail -n 40 ;;
  card_capacity)  # issue 43: the capacity config (examples/minicpmo45-capacity.yaml), 64 callers (~5 min)
    SERVE_READY_S=420 serve_conversation card_capacity examples/minicpmo45-capacity.yaml 64 60
    grep -E 'admitted / floor-limited|re-plan|engine ready' "$out/card_capacity_server.log" | tail -n 5 ;;
  card_bench)  # issue 43: `bench memory` on the exact shared config writes report.json's waterfall and waterfall.png
    step card_bench 560 python3 -m duplexcache.cli bench memory --config examples/minicpmo45-shared.yaml --device cuda \
      --sessions 1,2 --out "$out/card_bench" ;;
  serve_ragged_graphs)  # A/B of engine.cuda_graphs over the wire (issue 10): serve_conversation, a fresh server per
    # arm (off first); SERVE_BASE / SERVE_SESSIONS / SERVE_DURATION as for serve_catch_up, SERVE_OVERRIDES for both arms
    # (e.g. "scheduler.tick_phases=2": the ticks between are where the fixed part matters)
    # SERVE_RAGGED_ARMS: "false true" (the default: all eager vs the packaged default); "encoder", the arm's name
    # before issue 44 merged the graph switches, is "true". H100, 19 admitted callers (2026-12-06): ~2.5 min per arm
    for arm in ${SERVE_RAGGED_ARMS:-false true}; do
      case $arm in encoder|true) flags="engine.cuda_graphs=true" ;;
                   *) flags="engine.cuda_graphs=false" ;; esac
      serve_conversation "serve_ragged_graphs_$arm" "${SERVE_BASE:-examples/minicpmo45-shared.yaml}" "${SERVE_SESSIONS:-32}" \
        "${SERVE_DURATION:-45}" "$flags"
    done ;;
  soak)  # issue 46: an hour-long call shown in minutes. A fresh server on the exact shared config, SOAK_SESSIONS callers
    # (default 32, the exact-mode count of serve_conversation) for SOAK_SECONDS (default 540: 9 min) each, every caller
    # lowering its Thinker window by session.update to SOAK_WINDOW_HIGH / SOAK_WINDOW_LOW tokens (default 1024 / 512: the first
    # compaction within ~2 min, then one every minute or so) so each window compacts several times; a row every
    # SOAK_INTERVAL s (default 30): reply latency p50/p99, late ticks, device memory, bytes per pool, compactions
    # per session (soak/soak.json, .csv, .png; the log ends with the first-vs-last comparison). The whole mode takes
    # SOAK_SECONDS + the warm-up (~4 min) + ~1 min: over one 10-minute device call at the default, so split it or
    # lower SOAK_SECONDS there (e.g. SOAK_SECONDS=300 for a 5-minute soak)
    SERVE_BENCH=soak SERVE_STEP_LIMIT=$(( ${SOAK_SECONDS:-540} + 180 )) \
      SERVE_EXTRA="--interval ${SOAK_INTERVAL:-30} --window-high ${SOAK_WINDOW_HIGH:-1024} --window-low ${SOAK_WINDOW_LOW:-512}" \
      serve_conversation soak examples/minicpmo45-shared.yaml "${SOAK_SESSIONS:-32}" "${SOAK_SECONDS:-540}" ;;
  stage0)
    step gpu_stage0 120 python3 -m duplexcache.cli bench kernels --out "$out/gpu_stage0" ;;
  slope)  # issue 49: per-stage ms per extra session (the slope of p50 over the counts) beside the floor, --steady-window,
    # conversation workload. exact: the shared config's formats (examples/minicpmo45-shared.yaml: Code2Wav float32, KV
    # bf16); capacity: examples/minicpmo45-capacity.yaml's (Code2Wav bf16, KV fp8, 1024-token Talker turns). Each arm
    # fits one 10-minute call (SLOPE_ARMS="exact" or "capacity" runs one); counts past admission are recorded refused (the
    # examples' grid 1,...,32 at full windows on an H100: exact 30, capacity 58 admitted, 2026-12-07)
    for arm in ${SLOPE_ARMS:-exact capacity}; do
      case "$arm" in
        exact) counts=${SLOPE_EXACT_SESSIONS:-8,16,24,30}; formats="" ;;
        capacity) counts=${SLOPE_CAPACITY_SESSIONS:-16,32,48,58}
          formats="--code2wav-dtype bfloat16 --kv-cache-dtype fp8_e4m3 --talker-turn-tokens 1024" ;;
        *) echo "slope: unknown arm $arm (exact, capacity)"; continue ;;
      esac
      step "engine_ticks_slope_$arm" 580 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions "$counts" --workload conversation --steady-window --all-switches on --ticks 8 --warmup-ticks 8 --max-seconds 540 --memory-budget auto --graph-grid ${SLOPE_GRID:-1,4,8,12,16,20,24,28,32} $formats --out "$out/engine_ticks_slope_$arm"
      sed -n '/## Per-stage cost per extra session/,$p' "$out/engine_ticks_slope_$arm/results.md"
    done ;;
  wire)  # issue 49 over the wire: a fresh server per config, one caller past what each admits at full windows (the
    # examples' grid 1,...,32 on an 80 GB H100: exact 30, capacity 58; 2026-12-07), 60 s of conversation: every admitted
    # caller gets audio, 0 late ticks, reply p99 <= 1.5 s (~3.5 min per config on a warm machine; WIRE_CONFIGS picks)
    for arm in ${WIRE_CONFIGS:-exact capacity}; do
      case "$arm" in
        exact) SERVE_READY_S=300 SERVE_STEP_LIMIT=120 serve_conversation wire_exact examples/minicpmo45-shared.yaml "${WIRE_EXACT_CALLERS:-31}" 60 ;;
        capacity) SERVE_READY_S=300 SERVE_STEP_LIMIT=120 serve_conversation wire_capacity examples/minicpmo45-capacity.yaml "${WIRE_CAPACITY_CALLERS:-59}" 60 ;;
        *) echo "wire: unknown config $arm (exact, capacity)" ;;
      esac
    done ;;
  video)  # issue 47: `verify vision` at the real shapes (~2 GB of random float32 weights, ours + transformers' Idefics2
    # on the GPU, TF32 off), then `bench ticks` with every session a video session (a 640x480 JPEG per unit, 1 fps),
    # half video, half audio, and audio only (the baseline), at the same counts (32: past what the plan admits, so its
    # refusal names the admitted count). results.md: the vision stage's ms per tick and per extra session, the bytes
    # per video session (~10 min in all: split it over two calls)
    step verify_vision 300 python3 -m duplexcache.cli verify vision --preset minicpmo45 --random-weights --device cuda
    # --warm-up off: a warm-up per count (two with the measured re-plan, the first ~100 s with a cold Triton cache)
    # spent a 130 s step on one count (H100, 2026-12-07); the warm-up ticks capture the graphs instead. A fixed budget
    # over what is free after the weights (100 GiB, then 56 GiB on an 80 GB H100) ends the step at once: auto
    video="--ticks 4 --warmup-ticks 4 --warm-up off --memory-budget auto"
    step engine_ticks_video 200 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 1,8,16,21,32 $video --max-seconds 180 --video-share 1 --out "$out/engine_ticks_video"
    step engine_ticks_video_half 200 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 8,16,21,32 $video --max-seconds 180 --video-share 0.5 --out "$out/engine_ticks_video_half"
    step engine_ticks_audio 200 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 1,8,16,21,32 $video --max-seconds 180 --out "$out/engine_ticks_audio" ;;
  stage2)
    step gpu_stage2 300 python3 -m duplexcache.cli bench stage2 --out "$out/gpu_stage2" --batches 1,8,32 ;;
  batch_invariance)  # the current "Batch invariance on the GPU" table: engine.batch_invariant off vs on, beside 1, 7, 31,
    # the on arm also without the last-axis mean family (its A/B; ~4.5 min); then the on arm beside 31 traced, which names
    # the first stage that differs (its host copies slow the ticks, so the cost comes from the untraced run; ~1.5 min)
    step batch_invariance 420 python3 scripts/batch_invariance.py --preset minicpmo45 --device cuda --others 1,7,31 --units 5 --arms on,off --variants default,no_mean --out "$out/batch_invariance"
    step batch_invariance_trace 150 python3 scripts/batch_invariance.py --preset minicpmo45 --device cuda --others 31 --units 5 --arms on --trace --out "$out/batch_invariance_trace" ;;
  *) echo "unknown mode $mode (soak|smoke|suite|bench|setup|card_tests|card_waterfall|card_dialects|card_before|card_capacity|card_bench|serve_ragged_graphs|stage0|stage2|slope|wire|video|batch_invariance)"; exit 2 ;;
esac
done
