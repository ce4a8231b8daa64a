"""The tick's stages, in order: ``thinker_stage`` (context opens and chunked prefill, the audio
encoder step, the Thinker's append and decode), ``talker_stage`` (25 codes per speaking unit over
the Talker KV pool, through ``kv/talker_blocks``), ``code2wav_stage`` (chunking, Code2Wav steps,
a turn's stream and carried codes). They keep no state between ticks beyond each session's
audio-turn fields; ``runtime/engine_parts.run_units`` calls them in order."""
