"""A real Keras model for the tests of spec.trainer.modelFrom (decision 0206): trained by Keras
on mnist-5k, then saved compiled with SGD at a learning rate of 1e-9, so that ringtrain's
evaluation after a step is Keras' own accuracy of the saved weights — a job that ran any other
weights (a preset, a fresh initialisation) is told apart by its accuracy (≈ 0.1 against ≈ 0.85).

Keras and TensorFlow are imported by the function, not by importing this module (a cluster test
collects it without paying ~10 s of imports).
"""

from __future__ import annotations

import os
from pathlib import Path

#: Kept below a ConfigMap's 1 MiB: Flatten-Dense(16)-Dense(10), 12,730 parameters, ~70 KB.
HIDDEN = 16


def save_trained(path: Path, seed: int = 7) -> float:
    """Train the model in Keras, save it as ``path`` (.keras) and return Keras' accuracy of
    it on mnist-5k's 1,000 test digits, fed as the trainer feeds them (x / 255)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import numpy as np

    from ringtrain_trainer.data import dataset

    data = dataset.load("mnist-5k")
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((28, 28)),
            keras.layers.Flatten(),
            keras.layers.Dense(HIDDEN, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="shipped",
    )
    model.compile("adam", "sparse_categorical_crossentropy")
    x = (data.train.images / np.float32(255)).astype(np.float32)
    model.fit(x, data.train.labels, epochs=2, batch_size=32, verbose=0)
    model.compile(keras.optimizers.SGD(learning_rate=1e-9), "sparse_categorical_crossentropy")
    model.save(path)
    test = (data.test.images / np.float32(255)).astype(np.float32)
    predicted = model.predict(test, verbose=0).argmax(1)
    return float((predicted == data.test.labels).mean())
