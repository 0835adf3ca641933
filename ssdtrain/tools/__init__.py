"""The tools: ``ssdtrain probe`` and ``ssdtrain selftest``."""
