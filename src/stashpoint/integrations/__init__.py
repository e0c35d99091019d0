"""Adapters for the frameworks users train with. Each module imports its framework when it is
imported itself (never by ``import stashpoint``); install the matching extra, e.g.
``pip install 'stashpoint[lightning]'``.

- :mod:`stashpoint.integrations.lightning`: a PyTorch Lightning ``CheckpointIO`` plugin.
- :mod:`stashpoint.integrations.accelerate`: ``save_state`` / ``load_state`` for Hugging Face Accelerate.
- :mod:`stashpoint.integrations.torchtitan`: a torchtitan checkpoint manager, selected by one flag.
"""
