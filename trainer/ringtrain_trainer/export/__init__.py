"""The trained model leaves ringtrain: Keras ``.keras`` archives and ONNX models.

Everything here depends only on a Keras 3 Sequential config (a dict, ``json.loads`` of
``model.to_json()``) and the weights in ``model.get_weights()`` order, never on the trainer's
layers, so it is tested against real Keras and onnxruntime. ``ringtrain export`` (:mod:`.cli`)
turns a checkpoint into those two inputs.
"""

from ringtrain_trainer.export.keras_file import read_keras, write_keras
from ringtrain_trainer.export.layers import SUPPORTED
from ringtrain_trainer.export.onnx_file import write_onnx

__all__ = ["SUPPORTED", "read_keras", "write_keras", "write_onnx"]
