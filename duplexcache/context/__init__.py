"""Session context: MiniCPM-o 4.5 context layout, tokenizer fallback, cross-session context cache."""

from duplexcache.context.builder import (
    EmbeddingResult,
    ReferenceAudioError,
    SessionContext,
    SessionContextBuilder,
    build_session_context,
    validate_reference_audio,
)
from duplexcache.context.context_cache import ContextCache, ContextCacheEntry, EncoderPath, context_key, make_context_cache
from duplexcache.context.tokenizer import SPECIAL_TOKEN_IDS, ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer", "ContextCache", "ContextCacheEntry", "EmbeddingResult", "EncoderPath", "HFTokenizer",
    "ReferenceAudioError", "SPECIAL_TOKEN_IDS", "SessionContext", "SessionContextBuilder", "Tokenizer",
    "build_session_context", "context_key", "load_tokenizer", "make_context_cache", "validate_reference_audio",
]
