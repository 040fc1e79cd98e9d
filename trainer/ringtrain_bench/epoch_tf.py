"""One TensorFlow worker of `ringtrain bench epoch`: MultiWorkerMirroredStrategy over loopback.

Started twice by :mod:`ringtrain_bench.epoch`, each with its TF_CONFIG. Each worker trains on
exactly the examples the ringtrain worker of the same rank trains on (the trainer's own
:class:`~.data.dataset.Sharder`, same seed), from the same starting weights, with the
optimizer Keras deserializes from ringtrain's resolved serialization; gradients are summed by
the strategy's collective (Keras' optimizer all-reduces under a strategy) with each replica's
mean loss divided by the replica count, i.e. the mean over the global batch, as the ring
computes it. The chief then evaluates the whole test set. One JSON line on stdout per worker.
Like :mod:`ringtrain_bench.baseline_tf`, a child refuses to report what it was not asked to run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from ringtrain_trainer.data import dataset as data_mod


def _refuse(what: str) -> None:
    print(f"ringtrain bench epoch (TensorFlow side): {what}", file=sys.stderr)
    sys.exit(3)


def main(directory: str) -> None:
    setup = json.loads((Path(directory) / "setup.json").read_text())
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # nothing but the answer goes to the parent's stdout
    threads = setup["threads"]
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    if keras.backend.backend() != "tensorflow":
        _refuse(f"Keras runs the {keras.backend.backend()} backend, not TensorFlow")
    resolver = strategy.cluster_resolver
    rank, world = resolver.task_id, strategy.num_replicas_in_sync
    data = data_mod.load(setup["dataset"], setup["data_dir"])
    b = setup["batch_size"]
    sharder = data_mod.Sharder(len(data.train), b, world, rank, setup["seed"])
    steps = sharder.steps_per_epoch
    steps = min(steps, setup["steps"]) if setup["steps"] else steps
    with np.load(Path(directory) / "weights.npz") as z:
        weights = [z[f"arr_{i}"] for i in range(len(z.files))]
    with strategy.scope():
        if setup["keras_file"]:
            model = keras.models.load_model(setup["keras_file"], compile=False)
        else:
            model = keras.models.model_from_json(json.dumps(setup["keras_config"]))
        model.set_weights(weights)  # raises on any shape that differs
        optimizer = keras.optimizers.deserialize(setup["optimizer"])
        optimizer.build(model.trainable_variables)
    if sum(np.size(w) for w in model.get_weights()) != setup["weights"]:
        _refuse("the Keras model's weights are not ringtrain's")
    loss_fn = keras.losses.deserialize(setup["loss"])
    # per-example values: Keras' own mean would already divide by the replica count under a
    # strategy (``scale_loss_for_distribution``), the regularizers' penalty would not
    loss_fn.reduction = "none"
    shape = setup["input_shape"]

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(yb, model(xb, training=True)))
            if model.losses:
                loss = loss + tf.add_n(model.losses)
            scaled = loss / world  # summed over the replicas: the global batch's mean
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss  # this worker's batch loss, as a ringtrain worker reports its own

    @tf.function(jit_compile=False)
    def train_step(xb, yb):
        return strategy.experimental_local_results(strategy.run(replica_step, args=(xb, yb)))[0]

    train = data.train
    x = np.empty((b, *shape), np.float32)

    def batch(s: int):
        idx = sharder.indices(0, s)
        np.multiply(train.images[idx].reshape(b, *shape), np.float32(train.scale), out=x)
        return tf.constant(x), tf.constant(train.labels[idx])

    t0 = time.perf_counter()
    first = float(train_step(*batch(0)))  # the starting weights' loss on the first batch
    t1 = time.perf_counter()
    for s in range(1, steps):
        loss = train_step(*batch(s))
    last = float(loss)  # inside the timing: the last step has surely finished
    t2 = time.perf_counter()
    acc = None
    if rank == 0:
        test = data.test
        correct = 0
        for i in range(0, len(test.labels), 1000):
            xt = test.images[i : i + 1000].astype(np.float32) * np.float32(test.scale)
            pred = np.argmax(model(xt.reshape(-1, *shape), training=False), axis=-1)
            yt = test.labels[i : i + 1000]
            yt = np.argmax(yt, axis=-1) if yt.ndim > 1 else yt
            correct += int(np.sum(pred == yt))
        acc = correct / len(test.labels)
    answer = {
        "rank": rank,
        "steps": steps,
        "epoch_s": t2 - t0,
        "train_s": t2 - t1,
        "loss": last,
        "first_loss": first,
        "test_accuracy": acc,
        "tensorflow": tf.__version__,
        "strategy": type(strategy).__name__,
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
    }
    print(json.dumps(answer), file=answers, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
