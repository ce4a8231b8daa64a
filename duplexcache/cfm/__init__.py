"""Stage 2 (Code2Wav) batching with shared prompt attention (Tier B of the Two-Tier Omni Cache)."""
from duplexcache.cfm.arena import EulerArena
from duplexcache.cfm.code2wav import BatchedCode2Wav, SessionBytes, StepOutput, code2wav_session_bytes
from duplexcache.cfm.config import Code2WavConfig, Code2WavShape
from duplexcache.cfm.graph_grid import GraphGridError, arena_rows, replay_groups
from duplexcache.cfm.prompt_cache import PlainAttCache, SharedPromptAttCache
from duplexcache.cfm.prompt_registry import PromptRegistry, PromptState, VoicePrompt

__all__ = [
    "BatchedCode2Wav", "Code2WavConfig", "Code2WavShape", "EulerArena", "GraphGridError", "PlainAttCache",
    "PromptRegistry", "PromptState", "SessionBytes", "SharedPromptAttCache", "StepOutput", "VoicePrompt",
    "arena_rows", "code2wav_session_bytes", "replay_groups",
]
