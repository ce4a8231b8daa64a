"""The scheduler room: which sessions run in which tick, and when (``core.Scheduler``: unit
alignment, silence fill, early closes, phases, catch-up, take_units, the tick-cost model) and the
server's clock rules it shares with the server's tick loop (``pacing``: the unit grid, the
deadline after a late tick, prefill in the slack). Config section: ``scheduler``."""
