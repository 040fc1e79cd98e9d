"""The engine's ops, one family per file, in the ``layers.base.Layer`` protocol: ``params``,
``buffers``, ``forward``, ``backward_local``, ``backward_input`` (one gradient per input) and
``backward_weights``. Each op is built by its Keras registry entry (``keras/registry.py``) and
checked by tests/trainer/test_engine_ops.py's finite differences."""
