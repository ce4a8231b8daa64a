"""Memory planning: one budget carved at start (``admission``: the plan, the ledger of
reservations, admission by memory and by time; ``memory_budget``: ``engine.memory_budget`` auto or
bytes), each session's footprint and the plan from shapes (``session_sizing``), the pools and
graphs built to the plan (``device_setup``) and every byte of the card by part (``waterfall``).
Config sections: ``engine`` (budget, reserves, turn caps), ``precision`` (the formats' bytes)."""
