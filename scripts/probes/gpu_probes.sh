#!/usr/bin/env bash
# The GPU A/Bs and probes of earlier rounds, whose results are in docs/results/HISTORY.md (each section
# names its mode): they reproduce no current table of docs/benchmarks.md, and are kept so a settled
# decision can be re-checked on new hardware; and probes for an open issue (dit_conv_forms, c2w_solve_tiers, trace_gaps: issue 49). Usage, as
# scripts/gpu_bench.sh:
#   OUT=/path/to/results bash scripts/probes/gpu_probes.sh MODE [MODE ...]
. "$(dirname "$0")/../gpu_bench_lib.sh"

for mode in "${@:-serve_conversation}"; do
case "$mode" in
  bench_turn)  # issue 15 exact mode at the floor: bench with engine.talker_turn_tokens 1024 (the Talker reserve
    # per session 240 -> 60 MiB; the bench's one-turn run holds ~9 units, under the cap, so outputs are those of the default)
    step bench_turn1024 480 python3 -m duplexcache.cli bench memory --preset minicpmo45 --device cuda --sessions 1,2,4,8 --memory-budget 80GiB --talker-turn-tokens 1024 --out "$out/bench_turn1024" ;;
  bench_capacity)  # issue 15 capacity mode: bench with examples/minicpmo45-capacity.yaml (Code2Wav bf16, KV fp8, 1024-token
    # Talker turns): bytes per session, floor and the 80 GiB ceiling; the equality column compares configurations within the mode
    step bench_capacity 480 python3 -m duplexcache.cli bench memory --config examples/minicpmo45-capacity.yaml --preset minicpmo45 --device cuda --sessions 1,2,4,8 --memory-budget 80GiB --out "$out/bench_capacity" ;;
  ticks)  # issue 5: per-stage tick latency and the largest real-time session count (100 GiB: 32 sessions fit)
    step engine_ticks 260 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 1,8,16,32 --ticks 4 --max-seconds 200 --memory-budget 100GiB --out "$out/engine_ticks" ;;
  ticks_continuous)  # every session speaks every unit in one endless turn: one Code2Wav chunk per tick, no turn-end bursts;
    # 8 warm-up ticks: Code2Wav's cache reaches its steady P + 100 frames after 1 + ceil(300 / 50) = 7 units (before
    # that, every tick grows it to a new width and captures a graph for it)
    step engine_ticks_continuous 250 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 1,8,16,32 --ticks 4 --warmup-ticks 8 --max-seconds 210 --memory-budget 100GiB --speak-k 1000 --turn-units 1000 --out "$out/engine_ticks_continuous" ;;
  ticks_steady)  # as ticks_continuous, with every Thinker window filled to (low + high) / 2 = 7000 tokens first
    step engine_ticks_steady 220 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 1,8,16,32 --ticks 4 --warmup-ticks 8 --max-seconds 180 --memory-budget 100GiB --speak-k 1000 --turn-units 1000 --steady-window --out "$out/engine_ticks_steady" ;;
  ticks_ragged)  # A/B of stage0.ragged_kernel (default on): ticks_steady with the short ragged steps off the paged kernel
    step engine_ticks_ragged 220 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 1,8,16,32 --ticks 4 --warmup-ticks 8 --max-seconds 180 --memory-budget 100GiB --speak-k 1000 --turn-units 1000 --steady-window --ragged-kernel off --out "$out/engine_ticks_ragged" ;;
  ticks_eager)  # A/B of engine.cuda_graphs: the ticks sweep all eager (until issue 44, --decode-cuda-graphs off: the
    # decode steps only)
    step engine_ticks_eager 140 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 1,8 --ticks 4 --max-seconds 100 --memory-budget 100GiB --cuda-graphs off --out "$out/engine_ticks_eager" ;;
  ticks_conversation)  # issue 10: conversation workload (reply policy, user turns 2-6 s, replies 2-8 s, random phases,
    # 3 voices), every sharing switch on, Thinker windows filled to 7000 tokens; the auto budget (0.9 x free) admits 40-48 sessions if they
    # fit at all (a refusal is recorded and larger counts skipped). Expected wall time ~6-8 min (build ~1 min, then per
    # count: open + 8 warm-up + fill + 1 + 12 recorded ticks at 1-3 s each).
    step engine_ticks_conversation 560 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 16,32,40,48 --workload conversation --steady-window --all-switches on --ticks 12 --warmup-ticks 8 --max-seconds 480 --memory-budget auto --out "$out/engine_ticks_conversation" ;;
  serve_conversation)  # issue 10: the real server from a fresh process, 32 callers over WebSockets for 60 s.
    # The example config with engine.speak_policy.mode: reply (the conversation's replies come from the server's
    # policy). Expected wall time ~4 min: server start + warm-up <= 4 min (bounded), 5 s ramp + 60 s + drain.
    serve_conversation serve_conversation examples/minicpmo45-shared.yaml 32 60 ;;
  serve_sweep)  # issue 10: one fresh server, then 1, 32 and 40 callers in turn (45 s calls): the idle reply-latency
    # floor and the load over the wire. SERVE_BASE / SERVE_DURATION as for serve_catch_up (~5 min on an H200)
    SERVE_STEP_LIMIT=400 serve_conversation serve_sweep "${SERVE_BASE:-examples/minicpmo45-shared.yaml}" \
      "${SERVE_SESSIONS:-1,32,40}" "${SERVE_DURATION:-45}" ;;
  serve_align)  # issue 10, A/B with a fresh server per arm: units cut from each stream's first sample
    # (scheduler.align_units_to_ticks off: arm "off"), aligned to the tick grid with the policy's old whole-unit quiet
    # (engine.speak_policy.end_quiet_ms=1000: arm "on_quiet1000"), aligned with the default 200 ms (arm "on").
    # SERVE_ALIGN_ARMS picks arms (default "off on": ~5 min on an H200 at 32 callers; all three on a CPU:
    # SERVE_ALIGN_ARMS="off on_quiet1000 on" SERVE_BASE=duplexcache/configs/tiny.yaml SERVE_SESSIONS=1,8).
    # Every arm with one tick per unit, as measured (home phases need alignment); tick_phases first: each
    # override is validated as it is set
    for tag in ${SERVE_ALIGN_ARMS:-off on}; do
      case $tag in
        off) override="scheduler.tick_phases=1 scheduler.align_units_to_ticks=false" ;;
        on_quiet1000) override="scheduler.tick_phases=1 engine.speak_policy.end_quiet_ms=1000" ;;
        on) override=scheduler.tick_phases=1 ;;
        *) echo "serve_align: unknown arm $tag (off, on_quiet1000, on)"; continue ;;
      esac
      SERVE_STEP_LIMIT=${SERVE_STEP_LIMIT:-400} serve_conversation "serve_align_$tag" \
        "${SERVE_BASE:-examples/minicpmo45-shared.yaml}" "${SERVE_SESSIONS:-32}" "${SERVE_DURATION:-45}" "$override"
    done ;;
  serve_ptt)  # callers that keep the microphone open (workload conversation) vs push-to-talk callers that send only their
    # own turns (push_to_talk: the server hears silence once they are quiet, scheduler.fill_silence_after_ms), a fresh
    # server per arm. For a CPU host: SERVE_BASE=duplexcache/configs/tiny.yaml SERVE_SESSIONS=8
    for workload in conversation push_to_talk; do
      SERVE_WORKLOAD=$workload serve_conversation "serve_ptt_$workload" "${SERVE_BASE:-examples/minicpmo45-shared.yaml}" \
        "${SERVE_SESSIONS:-32}" "${SERVE_DURATION:-45}"
    done ;;
  serve_threads)  # A/B of server.compute_threads, a fresh server per arm in the order 2, auto, auto, 2 (auto: one fewer
    # than the CPUs on a CPU device, torch's own count on CUDA). For a CPU host: SERVE_BASE=duplexcache/configs/tiny.yaml
    # SERVE_SESSIONS=20 (the load where the 2-core machine had late ticks)
    i=0
    for arm in 2 auto auto 2; do
      i=$((i+1))
      serve_conversation "serve_threads_${i}_$arm" "${SERVE_BASE:-examples/minicpmo45-shared.yaml}" "${SERVE_SESSIONS:-20}" \
        "${SERVE_DURATION:-60}" "server.compute_threads=$arm"
    done ;;
  serve_catch_up)  # A/B of scheduler.catch_up_ticks, a fresh server per arm (off first). SERVE_BASE / SERVE_SESSIONS pick the
    # config and callers (default: the minicpmo45 example, 32); e.g. SERVE_BASE=duplexcache/configs/tiny.yaml on a CPU
    for arm in false true; do
      serve_conversation "serve_catch_up_$arm" "${SERVE_BASE:-examples/minicpmo45-shared.yaml}" "${SERVE_SESSIONS:-32}" \
        "${SERVE_DURATION:-60}" "scheduler.catch_up_ticks=$arm"
    done ;;
  ticks_vocoder)  # A/B of the vocoder's graphs (issue 15): ticks_profile's exact-mode 40 sessions with the vocoder
    # eager, then as graphs, each with 2 profiled ticks (launches and span of the vocoder), plus the vocoder's CUDA
    # tests (~6 min). Since issue 44 the switch is engine.cuda_graphs: the off arm has every graph off, not the vocoder's alone
    step vocoder_gpu_tests 120 python3 -m pytest -q -rs tests/cfm/test_vocoder_graphs.py tests/cfm/test_graphs.py tests/runtime/test_warmup.py -p no:cacheprovider
    step engine_ticks_vocoder_off 200 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 40 --workload conversation --steady-window --all-switches on --ticks 6 --warmup-ticks 8 --profile-ticks 2 --max-seconds 190 --memory-budget auto --graph-grid 1,4,8,16 --cuda-graphs off --out "$out/engine_ticks_vocoder_off"
    step engine_ticks_vocoder_on 200 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 40 --workload conversation --steady-window --all-switches on --ticks 6 --warmup-ticks 8 --profile-ticks 2 --max-seconds 190 --memory-budget auto --graph-grid 1,4,8,16 --cuda-graphs on --out "$out/engine_ticks_vocoder_on" ;;
  vocoder_exact)  # are the vocoder's graphs (engine.cuda_graphs) bit-exact? The vocoder's CUDA tests (two graphed stages give the same
    # bits; VOCODER_EXACT_TESTS=0 skips them), then the `duplexcache bench memory` equality check (every sharing
    # switch vs all_off) with the switch on
    [ "${VOCODER_EXACT_TESTS:-1}" = 0 ] || step vocoder_gpu_tests 150 python3 -m pytest -q -rs tests/cfm/test_vocoder_graphs.py tests/cfm/test_graphs.py tests/runtime/test_warmup.py -p no:cacheprovider
    python3 -c 'import sys; from duplexcache.config import DeployConfig
d = DeployConfig.from_packaged_yaml("minicpmo45"); d.engine.cuda_graphs = True; open(sys.argv[1], "w").write(d.to_yaml())' "$out/vocoder_on.yaml"
    step bench_vocoder_on 330 python3 -m duplexcache.cli bench memory --config "$out/vocoder_on.yaml" --preset minicpmo45 --device cuda --sessions ${BENCH_SESSIONS:-1,2,4} --memory-budget 80GiB --talker-turn-tokens 1024 --out "$out/bench_vocoder_on" ;;
  serve_vocoder)  # A/B of the vocoder's graphs over the wire: serve_conversation, a fresh server per arm (off first);
    # SERVE_BASE / SERVE_SESSIONS / SERVE_DURATION as for serve_catch_up. Since issue 44 the switch is engine.cuda_graphs
    # (the off arm: every graph off)
    for arm in false true; do
      serve_conversation "serve_vocoder_$arm" "${SERVE_BASE:-examples/minicpmo45-shared.yaml}" "${SERVE_SESSIONS:-32}" \
        "${SERVE_DURATION:-45}" "engine.cuda_graphs=$arm"
    done ;;
  serve_phases)  # A/B of scheduler.tick_phases (issue 10): serve_conversation with one tick per unit, then two (a
    # turn's unit closed with silence at the next half-unit tick, units kept on the unit tick), a fresh server per
    # arm; SERVE_BASE / SERVE_SESSIONS / SERVE_DURATION as for serve_catch_up, SERVE_PHASE_ARMS the arms (default
    # "1 2": tick_phases N; the runs in docs/results/ named "Nhome" are these, "N" > 1 the retired phase_units
    # spread, issue 44)
    for arm in ${SERVE_PHASE_ARMS:-1 2}; do
      serve_conversation "serve_phases_$arm" "${SERVE_BASE:-examples/minicpmo45-shared.yaml}" "${SERVE_SESSIONS:-32}" \
        "${SERVE_DURATION:-45}" "scheduler.tick_phases=$arm"
    done ;;
  ticks_conversation_large)  # ticks_conversation at 40 and 48 sessions only, with the shared graph grid warm
    step engine_ticks_conversation_large 560 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 40,48 --workload conversation --steady-window --all-switches on --ticks 8 --warmup-ticks 8 --max-seconds 420 --memory-budget auto --graph-grid 1,4,8,16 --out "$out/engine_ticks_conversation_large" ;;
  ticks_conversation_bf16)  # issue 15 capacity mode: ticks_conversation_large with precision.code2wav_dtype bfloat16
    # (40, 48, 56 sessions), then the float32 arm at 40 and 48 in the same run (the A/B)
    step engine_ticks_conversation_bf16 330 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 40,48,56 --workload conversation --steady-window --all-switches on --ticks 8 --warmup-ticks 8 --max-seconds 300 --memory-budget auto --graph-grid 1,4,8,16 --code2wav-dtype bfloat16 --out "$out/engine_ticks_conversation_bf16"
    step engine_ticks_conversation_f32 250 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 40,48 --workload conversation --steady-window --all-switches on --ticks 8 --warmup-ticks 8 --max-seconds 220 --memory-budget auto --graph-grid 1,4,8,16 --out "$out/engine_ticks_conversation_f32" ;;
  kv_precision)  # issue 15 capacity mode: Thinker K/V fp8_e4m3 vs bf16 on the same weights and tokens: top-1 agreement
    # and KL of next-token distributions at windows 1000/4000/8000 (4 sessions x 32 decode steps each), bytes per token;
    # then the audio encoder's cache in fp8 vs bf16 over 60 s (embeddings' relative error, bytes)
    step kv_precision 300 python3 scripts/probes/kv_precision.py --preset minicpmo45 --device cuda --sessions 4 --windows 1000,4000,8000 --decode 32 --out "$out/kv_precision" ;;
  ticks_conversation_fp8)  # issue 15 capacity mode, A/B in one run: bf16 Code2Wav with precision.kv_cache_dtype auto, then
    # fp8_e4m3 (Thinker and Talker KV at 0.52x bf16's bytes per token), 56 sessions each (~3 min per arm)
    for kv in auto fp8_e4m3; do
      step "engine_ticks_conversation_kv_$kv" 270 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 56 --workload conversation --steady-window --all-switches on --ticks 8 --warmup-ticks 8 --max-seconds 240 --memory-budget auto --graph-grid 1,4,8,16 --code2wav-dtype bfloat16 --kv-cache-dtype "$kv" --out "$out/engine_ticks_conversation_kv_$kv"
    done ;;
  ticks_capacity)  # issue 15 capacity mode, every format: Code2Wav bf16, KV and encoder cache fp8, 1024-token Talker turns;
    # conversation workload at 64, 80, 96 sessions (the issue's target: 96 real time); not run yet
    step engine_ticks_capacity 560 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 64,80,96 --workload conversation --steady-window --all-switches on --ticks 8 --warmup-ticks 8 --max-seconds 520 --memory-budget auto --graph-grid 1,4,8,16 --code2wav-dtype bfloat16 --kv-cache-dtype fp8_e4m3 --encoder-cache-dtype fp8_e4m3 --talker-turn-tokens 1024 --out "$out/engine_ticks_capacity" ;;
  ticks_profile)  # issue 15 per-stage cost: conversation ticks in exact mode at 40 sessions, then 2 ticks under
    # torch.profiler (host and device ms, syncs and launches per stage and Code2Wav part; the lines that synchronise)
    step engine_ticks_profile_exact 200 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 40 --workload conversation --steady-window --all-switches on --ticks 6 --warmup-ticks 8 --profile-ticks 2 --max-seconds 190 --memory-budget auto --graph-grid 1,4,8,16 --out "$out/engine_ticks_profile_exact" ;;
  ticks_profile_small)  # issue 10: what the fixed part of a tick is made of. A tick between unit ticks of 1-2 reply
    # starts took 0.25-0.5 s on the H200 at 32 callers (docs/results/HISTORY.md, "Units on the unit tick"). Profiles ticks
    # of 1, 2 and 4 sessions in exact mode (host and device ms, launches, syncs per stage): first every session
    # speaking every tick (continuous: every profiled tick speaks), then one-unit replies every other tick (turns
    # k=2: a reply start every second tick); ~4 min
    step engine_ticks_profile_small 230 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 1,2,4 --workload continuous --steady-window --all-switches on --ticks 6 --warmup-ticks 8 --profile-ticks 2 --max-seconds 220 --memory-budget auto --graph-grid 1,4,8,16 --out "$out/engine_ticks_profile_small"
    step engine_ticks_profile_small_turns 160 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 1,2 --workload turns --speak-k 2 --turn-units 1 --steady-window --all-switches on --ticks 8 --warmup-ticks 8 --profile-ticks 2 --max-seconds 150 --memory-budget auto --graph-grid 1,4,8,16 --out "$out/engine_ticks_profile_small_turns" ;;
  ticks_ragged_graphs)  # cumulative A/B of the launch-bound stages' graphs (issue 10): ticks of 1 and 2 sessions, every
    # session speaking every tick (continuous); arms: off (engine.cuda_graphs off: all eager), on (the default). Until
    # issue 44 merged the graph switches, "on" was the ragged steps alone and "encoder" both (now "encoder" = "on").
    # One process per arm, 2 profiled ticks each (launches per stage); ~2.5 min per arm. RAGGED_ARMS picks arms
    for arm in ${RAGGED_ARMS:-off on}; do
      case $arm in off) flags="--cuda-graphs off" ;;
                   *) flags="--cuda-graphs on" ;; esac
      # shellcheck disable=SC2086
      step "engine_ticks_ragged_graphs_$arm" 170 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 1,2 --workload continuous --steady-window --all-switches on --ticks 6 --warmup-ticks 8 --profile-ticks 2 --max-seconds 160 --memory-budget auto --graph-grid 1,4,8,16 $flags --out "$out/engine_ticks_ragged_graphs_$arm"
    done ;;
  ticks_capacity_mid)  # issue 15 capacity mode (every format) at 64 sessions, conversation workload
    step engine_ticks_capacity_mid 250 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 64 --workload conversation --steady-window --all-switches on --ticks 6 --warmup-ticks 8 --max-seconds 240 --memory-budget auto --graph-grid 1,4,8,16 --code2wav-dtype bfloat16 --kv-cache-dtype fp8_e4m3 --encoder-cache-dtype fp8_e4m3 --talker-turn-tokens 1024 --out "$out/engine_ticks_capacity_mid" ;;
  ticks_wire_gap)  # issue 10: in-process conversation ticks at 32 sessions, to set against serve_conversation's 32 callers
    # over the wire (whose results.json has the server's stage_ms_mean): is the gap the wire or the engine? (~4 min)
    step engine_ticks_conversation32 290 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 32 --workload conversation --steady-window --all-switches on --ticks 8 --warmup-ticks 8 --max-seconds 250 --memory-budget auto --graph-grid 1,4,8,16 --out "$out/engine_ticks_conversation32" ;;
  ticks_exact48)  # issue 15: exact mode at 48 sessions only (1024-token Talker turns), conversation workload (~3.5 min)
    step engine_ticks_exact48 200 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 48 --workload conversation --steady-window --all-switches on --ticks 6 --warmup-ticks 8 --max-seconds 190 --memory-budget auto --graph-grid 1,4,8,16 --talker-turn-tokens 1024 --out "$out/engine_ticks_exact48" ;;
  ticks_recheck|ticks_recheck_exact|ticks_recheck_capacity)  # issue 15: exact mode at 48 sessions (1024-token Talker
    # turns, so 48 fit), then the capacity config at 64 with the encoder cache in fp8 (~8 min); the _exact / _capacity
    # modes run one half each (one fits a device call beside another mode)
    [ "$mode" = ticks_recheck_capacity ] || step engine_ticks_exact48 200 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 48 --workload conversation --steady-window --all-switches on --ticks 6 --warmup-ticks 8 --max-seconds 190 --memory-budget auto --graph-grid 1,4,8,16 --talker-turn-tokens 1024 --out "$out/engine_ticks_exact48"
    [ "$mode" = ticks_recheck_exact ] || step engine_ticks_capacity64_fp8enc 250 python3 -m duplexcache.cli bench ticks --preset minicpmo45 --device cuda --sessions 64 --workload conversation --steady-window --all-switches on --ticks 6 --warmup-ticks 8 --max-seconds 240 --memory-budget auto --graph-grid 1,4,8,16 --code2wav-dtype bfloat16 --kv-cache-dtype fp8_e4m3 --encoder-cache-dtype fp8_e4m3 --talker-turn-tokens 1024 --out "$out/engine_ticks_capacity64_fp8enc" ;;
  dit_conv_forms)  # issue 49: the DiT causal conv block as the engine runs it (transposes around a cuDNN Conv1d:
    # 1936 layout conversions per capacity tick at 59 sessions) vs time-major GEMMs, bf16 and float32, with errors (~1 min)
    step dit_conv_forms 120 python3 scripts/probes/dit_conv_forms.py --preset minicpmo45 --device cuda --out "$out/dit_conv_forms" ;;
  c2w_solve_tiers)  # issue 49: a whole-Euler Code2Wav solve per graph tier (fixed ms + ms a row), the fused DiT
    # kernels vs the torch operators in one process, one replay's kernels (~3 min)
    step c2w_solve_tiers 300 python3 scripts/probes/c2w_solve_tiers.py --tiers 1,4,8,16,24,32 --profile-tiers 1,16 --out "$out/c2w_solve_tiers" ;;
  trace_gaps)  # issue 49: where the device waits in an exact tick at full windows (scripts/probes/trace_gaps.py)
    TRACE_OUT="$out/trace_gaps" step trace_gaps 420 python3 scripts/probes/trace_gaps.py bench ticks --preset minicpmo45 --device cuda --workload conversation --steady-window --all-switches on --warmup-ticks 6 --memory-budget auto --profile-ticks 2 --sessions 30 --ticks 3 --max-seconds 400 --out "$out/trace_gaps_ticks" ;;
  precision)  # issue 15 capacity mode: Code2Wav bfloat16 vs float32 on the same weights: error over a 60 s call, bytes, ms per step
    step precision 240 python3 scripts/probes/code2wav_precision.py --preset minicpmo45 --device cuda --sessions 4 --chunks 60 --batches 1,8,32 --out "$out/precision" ;;
  serve_precision)  # issue 15 capacity mode over the wire: serve_conversation with precision.code2wav_dtype float32,
    # then bfloat16, a fresh server per arm; SERVE_BASE / SERVE_SESSIONS / SERVE_DURATION as for serve_catch_up
    for arm in float32 bfloat16; do
      serve_conversation "serve_precision_$arm" "${SERVE_BASE:-examples/minicpmo45-shared.yaml}" \
        "${SERVE_SESSIONS:-32}" "${SERVE_DURATION:-60}" "precision.code2wav_dtype=$arm"
    done ;;
  serve_prefill_between)  # A/B of scheduler.prefill_between_ticks over the wire, a fresh server per arm (off first);
    # SERVE_BASE / SERVE_SESSIONS / SERVE_DURATION as for serve_catch_up
    for arm in false true; do
      serve_conversation "serve_prefill_between_$arm" "${SERVE_BASE:-examples/minicpmo45-shared.yaml}" \
        "${SERVE_SESSIONS:-32}" "${SERVE_DURATION:-60}" "scheduler.prefill_between_ticks=$arm"
    done ;;
  serve_long_context)  # issue 11 over the wire: 32 callers, then one caller with a ~15000-token context joins 10 s in;
    # A/B of scheduler.prefill_between_ticks, a fresh server per arm (off first). SERVE_BASE / SERVE_SESSIONS as above
    for arm in false true; do
      SERVE_EXTRA="--long-context-callers 1 --long-context-chars ${LONG_CONTEXT_CHARS:-15000} --long-context-at 10" \
        serve_conversation "serve_long_context_$arm" "${SERVE_BASE:-examples/minicpmo45-shared.yaml}" \
        "${SERVE_SESSIONS:-32}" "${SERVE_DURATION:-60}" "scheduler.prefill_between_ticks=$arm"
    done ;;
  serve_profile)  # issue 10: who holds the GIL in a fresh server under 32 callers (needs py-spy on PATH: carry its
    # wheel; installed with --target DIR it is DIR/bin/py-spy). SERVE_BASE / SERVE_SESSIONS as for serve_catch_up
    step serve_profile 420 python3 scripts/probes/serve_profile.py --config "${SERVE_BASE:-examples/minicpmo45-shared.yaml}" \
      --sessions "${SERVE_SESSIONS:-32}" --duration "${SERVE_DURATION:-60}" --out "$out/serve_profile" ;;
  prefill)  # issue 11: the longest allowed context (16384 tokens) opening beside 32 live sessions, plus the attention A/B
    step prefill_attention 120 python3 scripts/probes/prefill_attention_ab.py --out "$out/prefill_attention"
    step prefill_isolation 400 python3 scripts/probes/prefill_isolation.py --preset minicpmo45 --device cuda --sessions 32 --memory-budget 100GiB --out "$out/prefill_isolation" ;;
  prefill_between)  # issue 11: the same with scheduler.prefill_between_ticks emulated (chunks in each period's slack)
    step prefill_isolation_between 400 python3 scripts/probes/prefill_isolation.py --preset minicpmo45 --device cuda --sessions 32 --memory-budget 100GiB --between-ticks --out "$out/prefill_isolation_between" ;;
  prefill_512)  # prefill with engine.prefill_chunk_tokens 512 (the 16384-token context opens in 32 ticks)
    step prefill_isolation_512 400 python3 scripts/probes/prefill_isolation.py --preset minicpmo45 --device cuda --sessions 32 --memory-budget 100GiB --prefill-chunk-tokens 512 --out "$out/prefill_isolation_512" ;;
  warm_start)  # issue 10: warm-up time and graphs, then 24 sessions at once: captures per tick (0) and first audio; --no-warmup is the cold A/B
    step warm_start 420 python3 scripts/probes/warm_start.py --config examples/minicpmo45-shared.yaml --sessions 24 --ticks 4 --out "$out/warm_start"
    step cold_start 420 python3 scripts/probes/warm_start.py --config examples/minicpmo45-shared.yaml --sessions 24 --ticks 4 --no-warmup --out "$out/cold_start" ;;
  serve_ready)  # issue 10: `duplexcache serve` from launch to /health 200, then the graph-capture counters on /metrics
    step serve_ready 480 python3 scripts/probes/serve_ready.py --config examples/minicpmo45-shared.yaml --port 8765 ;;
  *) echo "unknown mode $mode (bench_turn|bench_capacity|ticks|ticks_continuous|ticks_steady|ticks_ragged|ticks_eager|ticks_conversation|serve_conversation|serve_sweep|serve_align|serve_ptt|serve_threads|serve_catch_up|ticks_vocoder|vocoder_exact|serve_vocoder|serve_phases|ticks_conversation_large|ticks_conversation_bf16|kv_precision|ticks_conversation_fp8|ticks_capacity|ticks_profile|ticks_profile_small|ticks_ragged_graphs|ticks_capacity_mid|ticks_wire_gap|ticks_exact48|ticks_recheck|ticks_recheck_exact|ticks_recheck_capacity|precision|serve_precision|serve_prefill_between|serve_long_context|serve_profile|prefill|prefill_between|prefill_512|warm_start|serve_ready)"; exit 2 ;;
esac
done
