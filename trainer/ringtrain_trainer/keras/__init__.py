"""The one Keras front end: the only package that reads or writes Keras JSON.

``config`` parses a Sequential or Functional ``model.to_json()`` into a validated graph of
:class:`~.config.LayerSpec` (pure: no numpy, shape arithmetic only, so the operator can run it
on every reconcile); ``registry`` maps each Keras class name to one :class:`~.entry.Entry`
holding everything about that layer (arguments, output shape, weights, the engine op it builds,
its ONNX nodes); ``archive`` reads and writes ``.keras`` files and emits Keras configs. The
trainer (``keras_model``) and the exporters (``export``) both start here.
"""
