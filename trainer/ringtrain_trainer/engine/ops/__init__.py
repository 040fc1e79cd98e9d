"""The engine's ops, one family per file, in the ``engine.op.Op`` protocol: ``params``,
``buffers``, ``bind``, ``forward``, ``backward_local``, ``backward_input`` (one gradient per
input), ``backward_weights`` and ``flops``. Each op is built by its Keras registry entry
(``keras/registry.py``) and checked against finite differences (``support.gradcheck``).

Families: ``conv`` (Conv1D/Conv2D), ``depthwise`` (Depthwise and Separable convolution),
``pool`` (window and global pooling), ``shape`` (zero padding, cropping, up-sampling),
``merge`` (Concatenate, Multiply, ...), ``elementwise`` (Activation layers, Rescaling, Add),
``dense``, ``batchnorm``, ``dropout``, ``fused`` (ConvPool and Dense, the seeds' fast path),
``activations`` (every Keras activation in common use, one
table), ``initializers`` and ``regularizers``; ``window`` holds the padding arithmetic the
window ops share. Channels-last only; every op is dtype-agnostic (the Program chooses float32,
the gradient checks float64) and allocates nothing per step beyond row-sized reductions."""
