"""The trained model leaves ringtrain: Keras ``.keras`` archives and ONNX models.

Everything here depends only on a Keras config (a dict, ``json.loads`` of ``model.to_json()``)
and the weights in ``model.get_weights()`` order, read through the one Keras front end
(``ringtrain_trainer.keras``), never on the trainer's ops, so it is tested against real Keras
and onnxruntime. ``ringtrain export`` (:mod:`.cli`) turns a checkpoint into those two inputs.
"""

from ringtrain_trainer.export.onnx_file import write_onnx
from ringtrain_trainer.keras.archive import read_keras, write_keras
from ringtrain_trainer.keras.registry import SUPPORTED

__all__ = ["SUPPORTED", "read_keras", "write_keras", "write_onnx"]
