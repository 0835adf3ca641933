"""The planner: ``ssdtrain plan``, a run sized before it starts (memory, drive, longest sequence)."""
