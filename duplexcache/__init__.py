"""duplexcache: serve full-duplex omni speech models to many live sessions per GPU.

The Two-Tier Omni Cache stores what sessions have in common (system context, reference-voice
embeddings, the voice prompt's attention state) once, so a session costs only its own bytes.
"""

__version__ = "0.1.0"
