"""Long context on one device: sequence-tiled MLPs (``tiled``), a switch for Hugging Face decoders (``hf``)."""
