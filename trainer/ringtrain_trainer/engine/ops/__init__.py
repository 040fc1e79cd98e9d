"""The engine's ops, one family per file, all in the layer protocol of ``layers.base``
(``params``, ``buffers``, ``bind``, ``forward``, ``backward_local``, ``backward_input``,
``backward_weights``, ``flops``): ``conv`` (Conv1D/Conv2D), ``depthwise`` (Depthwise and
Separable convolution), ``pool`` (window and global pooling), ``shape`` (zero padding, cropping,
up-sampling), ``activations`` (every Keras activation in common use, one table),
``initializers`` and ``regularizers``. ``window`` holds the padding arithmetic they share.

Channels-last only; every op is dtype-agnostic (the Program chooses float32, the gradient
checks float64) and allocates nothing per step beyond a few row-sized reductions."""
