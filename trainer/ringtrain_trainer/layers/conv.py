"""The registry's 2-D window layers by their old names, each built by its one implementation
in ``engine.ops``: :func:`Conv2D` is ``conv.Conv`` (undilated), :func:`Pool2D` is
``pool.Pool``, :func:`GlobalAvgPool2D` is ``pool.GlobalPool``. There used to be a second im2col
Conv2D and pooling here, twins of the engine's (their buffers, bind and FLOPs written twice);
the engine's are the ones the tests check against Keras and finite differences. (Imported
when called: the engine's ops import ``layers.base``, so this package.)"""

from __future__ import annotations

from ringtrain_trainer.engine.ops.window import same_pad

__all__ = ["Conv2D", "GlobalAvgPool2D", "Pool2D", "same_pad"]


def Conv2D(
    in_shape, filters, kernel, strides=(1, 1), padding="valid", activation="linear", use_bias=True
):
    """Keras ``Conv2D`` without dilation, in the registry's argument order."""
    from ringtrain_trainer.engine.ops.conv import Conv

    return Conv(in_shape, filters, kernel, strides, padding, 1, activation, use_bias)


def Pool2D(in_shape, kind, pool, strides=None, padding="valid"):
    """Keras ``MaxPooling2D`` / ``AveragePooling2D``."""
    from ringtrain_trainer.engine.ops.pool import Pool

    return Pool(in_shape, kind, pool, strides, padding)


def GlobalAvgPool2D(in_shape):
    """Keras ``GlobalAveragePooling2D`` (``keepdims=False``)."""
    from ringtrain_trainer.engine.ops.pool import GlobalPool

    return GlobalPool(in_shape, "avg")
