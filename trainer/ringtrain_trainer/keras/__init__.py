"""The one Keras front end: the only package that reads or writes Keras JSON.

``config`` parses a Sequential or Functional ``model.to_json()`` into a validated graph of
:class:`~.layer_spec.LayerSpec` (shape arithmetic only: a 2 KB spec may describe a 40 GB model,
and nothing is allocated before ``budget`` has checked it); ``registry`` maps each Keras class
name to one :class:`~.entry.Entry` holding everything about that layer (arguments, output shape,
weights, the engine op it builds, its ONNX nodes); ``lowering`` and ``load`` turn a parsed model
into the engine's ops; ``archive`` reads and writes ``.keras`` files and emits Keras configs. The
trainer and the exporters (``export``) both start here; the operator asks the same code in a
child process (``ringtrain_trainer.sizing``).
"""
