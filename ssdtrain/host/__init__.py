"""The host tier: pinned host memory in front of the drives, its copies and the copy clock."""
