"""Tokenizers for the session context: a real HF tokenizer when a checkpoint has one, else a
deterministic byte-level fallback with MiniCPM-o's special-token ids.

Weights and tokenizers cannot be downloaded here, so every preset runs with the fallback unless
``checkpoint_dir`` holds a tokenizer. The fallback is not MiniCPM-o's BPE: text ids differ from
the real model's, but the layout (which positions are special, text or audio) is the same, and
memory and speed do not depend on which ids the text gets.

Special-token ids. Given by the spec: ``<unit>`` 151683, ``</unit>`` 151684, ``<|tts_bos|>``
151703, ``<|listen|>`` 151705, ``<|speak|>`` 151706, ``<|chunk_eos|>`` 151718, ``<|tts_pad|>``
151722. Chosen here (documented, not verified against a MiniCPM-o 4.5 tokenizer, which is not
available): ``<|im_start|>`` 151644 and ``<|im_end|>`` 151645 as in the Qwen3 vocabulary the
Thinker inherits; ``<|audio_start|>`` 151697, ``<|audio|>`` 151698 (the filler id at audio
positions) and ``<|audio_end|>`` 151699, the slots MiniCPM-o 2.6 gave them just below
``<|tts_bos|>`` 151703, which 4.5 keeps. Vision (read from MiniCPM-o 4.5's ``added_tokens.json`` /
``tokenizer_config.json``): ``<image>`` 151669, ``</image>`` 151670, ``<slice>`` 151679, ``</slice>``
151680, and ``<unk>`` 128244, the processor's placeholder at the 64 vision positions of a frame
(below FIRST_SPECIAL_ID: it is an added token of the Qwen vocabulary's upper range, never
produced by ``encode``). A real tokenizer's ids always win over this table.
"""

from __future__ import annotations

import collections
import logging
import threading
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

SPECIAL_TOKEN_IDS: dict[str, int] = {
    "<unk>": 128244,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<image>": 151669,
    "</image>": 151670,
    "<slice>": 151679,
    "</slice>": 151680,
    "<unit>": 151683,
    "</unit>": 151684,
    "<|audio_start|>": 151697,
    "<|audio|>": 151698,
    "<|audio_end|>": 151699,
    "<|tts_bos|>": 151703,
    "<|listen|>": 151705,
    "<|speak|>": 151706,
    "<|turn_eos|>": 151717,
    "<|chunk_eos|>": 151718,
    "<|tts_pad|>": 151722,
}
# The id written at reference-audio positions of token_ids (the embeddings replace it).
AUDIO_FILLER_TOKEN = "<|audio|>"
# Qwen's first special id; every ordinary text id must be below it.
FIRST_SPECIAL_ID = 151643


@runtime_checkable
class Tokenizer(Protocol):
    """What the context builder needs from a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Ordinary text to ids; special-token spellings in ``text`` are NOT parsed as specials."""
        ...

    def token_id(self, token: str) -> int:
        """The id of one special token (e.g. ``"<|im_start|>"``); KeyError if unknown."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus the special-token table above.

    Ids 0..255 are far below FIRST_SPECIAL_ID, so text can never alias a special token, and they
    exist in every vocabulary the presets build (the tiny preset's included).
    """

    def __init__(self, special_token_ids: dict[str, int] | None = None):
        self.special_token_ids = dict(SPECIAL_TOKEN_IDS if special_token_ids is None else special_token_ids)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def token_id(self, token: str) -> int:
        try:
            return self.special_token_ids[token]
        except KeyError:
            raise KeyError(f"unknown special token {token!r}") from None


class HFTokenizer:
    """Adapter over a ``transformers`` tokenizer loaded from a checkpoint directory."""

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer

    def encode(self, text: str) -> list[int]:
        # split_special_tokens: a user typing "<|im_end|>" must not end the system turn.
        return list(self._tok.encode(text, add_special_tokens=False, split_special_tokens=True))

    def token_id(self, token: str) -> int:
        token_id = self._tok.convert_tokens_to_ids(token)
        if token_id is None or token_id == self._tok.unk_token_id:
            raise KeyError(f"checkpoint tokenizer has no special token {token!r}")
        return int(token_id)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


class MemoTokenizer:
    """A tokenizer that remembers the ids of its last few long texts (thread-safe).

    The engine tokenizes a session's context twice: once in ``open_session``, on the caller's
    worker thread, to size it (SessionSizing.context_layout), and again when the tick builds it
    (ThinkerStage.open_pending). With both going through one MemoTokenizer the tick finds the
    ids ready, so tokenizing instructions never runs on the tick's time (issue 48: 3.9 MB of
    instructions took 0.5-2.2 s to tokenize). Short texts are not remembered: they cost less
    than the lookup. Everything else is the wrapped tokenizer's."""

    MIN_CHARS = 256      # shorter texts are tokenized each time
    ENTRIES = 32         # texts remembered (the newest); a context is a handful of them

    def __init__(self, inner: Tokenizer):
        self._inner = inner
        self._lock = threading.Lock()
        self._ids: collections.OrderedDict[str, list[int]] = collections.OrderedDict()

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str) or len(text) < self.MIN_CHARS:
            return self._inner.encode(text)
        with self._lock:
            ids = self._ids.get(text)
            if ids is not None:
                self._ids.move_to_end(text)
                return list(ids)    # a copy: a caller may extend what it is given
        ids = self._inner.encode(text)
        with self._lock:
            self._ids[text] = ids
            while len(self._ids) > self.ENTRIES:
                self._ids.popitem(last=False)
        return list(ids)

    def token_id(self, token: str) -> int:
        return self._inner.token_id(token)

    def __getattr__(self, name: str) -> Any:
        # what else a caller reads of the real tokenizer (special_token_ids, HF's inner _tok)
        return getattr(self._inner, name)


def load_tokenizer(checkpoint_dir: str | Path | None) -> Tokenizer:
    """The checkpoint's own tokenizer if ``checkpoint_dir`` has one, else :class:`ByteTokenizer`."""
    if checkpoint_dir is not None:
        path = Path(checkpoint_dir)
        if not path.is_dir():
            raise ValueError(f"checkpoint_dir {str(path)!r} is not a directory")
        if any((path / name).exists() for name in _TOKENIZER_FILES):
            from transformers import AutoTokenizer  # lazy: only with a real checkpoint

            logger.info("loading tokenizer from %s", path)
            return HFTokenizer(AutoTokenizer.from_pretrained(str(path), trust_remote_code=False))
        logger.warning("no tokenizer in %s; using the byte-level fallback tokenizer", path)
    return ByteTokenizer()
