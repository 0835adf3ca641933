"""The device: everything that touches ``torch.cuda`` (fences, streams, pinned memory, device
copies, the allocator's counts and device time), below the stores, the host tier and the engine.

``cuda.py`` is the seam that the stores, the host tier and the engine call (imported as
``device``); ``copies.py`` holds the host tier's batched copies and ``measure.py`` what the
device reports (memory, time, copy rate). ``model.py`` (with ``model_streams.py``, ``model_ops.py``,
``rates.py``) is the modelled GPU beside the real one: a virtual clock, set rates, poisoned buffers.
"""
