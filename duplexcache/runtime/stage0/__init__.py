"""Stage 0: the Thinker's sessions over the paged KV (``runner.Stage0Runner`` over
``kv/kv_cache_manager.KVCacheManager`` and its ``BlockPool``: the Thinker KV pool, anchor blocks
shared, window private), the typed objects and the worst-case formula (``types``) and the window
(``window``: compaction, truncation, bytes per session). Config section: ``stage0``."""
