"""The trainer's modules read their defaults and choices from the option table, never their own."""

from __future__ import annotations

import inspect

from ringtrain import options
from ringtrain_trainer import optim, reducer, ring
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.data import dataset as data
from ringtrain_trainer.engine import handwritten as model
from ringtrain_trainer.ipu import device as ipu
from ringtrain_trainer.ring.engine import RingCollective


def test_the_tables_choices_are_what_the_trainer_implements():
    assert options.MODELS == model.MODELS
    assert options.OPTIMIZERS == optim.OPTIMIZERS
    assert options.DATASETS == data.DATASETS
    assert options.TRANSPORTS == ring.TRANSPORTS
    from ringtrain_trainer.export.cli import FORMATS

    assert options.EXPORT_FORMATS == FORMATS
    assert options.DEFAULTS["data_dir"] == data.FASHION_MNIST_DIR


def test_module_defaults_are_the_tables():
    d = options.DEFAULTS
    cfg = TrainerConfig()
    assert ipu.IPUConfig().memory_bytes == d["ipu_memory_mb"] * ipu.MB == cfg.ipu_memory_mb * ipu.MB
    assert ipu.IPUConfig().variables_on_host is d["variables_on_host"] is cfg.variables_on_host
    assert ipu.IPUConfig().replicas == d["ipus_per_worker"]
    assert reducer.DEFAULT_BUCKET_BYTES == cfg.bucket_bytes == 25 << 20
    assert ring.DEFAULT_STEP_TIMEOUT_S == d["ring_step_timeout_s"] == 30.0
    assert ring.DEFAULT_CONNECT_TIMEOUT_S == d["ring_connect_timeout_s"] == 120.0
    engine_default = inspect.signature(RingCollective).parameters["step_timeout_s"].default
    assert engine_default == d["ring_step_timeout_s"]


def test_every_worker_option_is_a_config_field_with_the_tables_default():
    cfg = TrainerConfig()
    for o in options.WORKER:
        assert getattr(cfg, o.name) == o.default, o.name
        assert TrainerConfig.parser().get_default(o.name) == o.default, o.name
