"""The engine: the saved-tensor hooks and what they drive (cache, write queue, reader, schedule, keep rules, counters)."""
