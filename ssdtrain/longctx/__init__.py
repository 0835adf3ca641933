"""Long context on one device: sequence-tiled MLPs (``tiled``) and a one-call switch for Hugging Face decoders (``hf``)."""
