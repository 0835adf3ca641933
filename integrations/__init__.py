"""Plugins that switch ssdtrain on from inside a training framework.

Each plugin is its own module (``ssdtrain.integrations.deepspeed``, ``ssdtrain.integrations.megatron``)
and imports its framework only when it is used, so importing this package imports no framework.
"""
