"""The host tier: pinned host memory in front of the drives and the copy clock (its copies: ``ssdtrain/device/``)."""
