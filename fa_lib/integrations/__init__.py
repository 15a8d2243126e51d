"""Integrations of fa_lib with other libraries, one module each, imported only on demand.

* ``fa_lib.integrations.transformers``: ``register()`` makes ``attn_implementation="fa_lib"`` available to
  HuggingFace transformers models (an attention function and the mask function it needs).

Importing ``fa_lib`` or this package imports none of those libraries.
"""
