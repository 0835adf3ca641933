"""The tools: ``ssdtrain probe`` and ``ssdtrain selftest``, and the drive-endurance monitor."""
