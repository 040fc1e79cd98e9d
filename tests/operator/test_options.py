"""The option table (trainer/ringtrain/options.py) is the one definition of a trainer option.

Every option must mean the same on both sides: the CRD's default is the worker's default, a
spec.trainer field reaches the worker as the flag that parses back to the same value, and the
checked-in CRD files (the operator's and the chart's) and docs are what the table generates.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gen_crd
import pytest
import yaml
from operator_jobs import job_obj

from ringtrain import optiongen, options
from ringtrain.errors import InvalidSpec
from ringtrain_operator import manifests, spec
from ringtrain_operator.job import TrainerSpec
from ringtrain_trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]
GEN_CRD = ROOT / "hack" / "gen-crd"


def _trainer_schema(path: Path) -> dict:
    crd = yaml.safe_load(path.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["trainer"]


def _crd_node(path: str) -> dict:
    node = spec.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["trainer"]
    for part in path.split("."):
        node = node["properties"][part]
    return node


@pytest.mark.parametrize("path", gen_crd.CRDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_both_crd_files_hold_the_generated_trainer_schema(path):
    assert path.read_text() == gen_crd.render(path.read_text()), (
        f"{path} is stale: run .venv/bin/python hack/gen-crd"
    )
    assert _trainer_schema(path) == optiongen.trainer_schema()


def test_gen_crd_check_passes_now_and_fails_with_a_diff_on_a_stale_block(tmp_path):
    ok = subprocess.run(
        [sys.executable, str(GEN_CRD), "--check"], capture_output=True, text=True, check=False
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    stale = gen_crd.CRDS[0].read_text().replace("maximum: 86400", "maximum: 600", 1)
    assert gen_crd.render(stale) == gen_crd.CRDS[0].read_text(), "only the block is replaced"


@pytest.mark.parametrize("o", options.CRD, ids=lambda o: o.name)
def test_crd_default_and_bounds_are_the_tables(o):
    node = _crd_node(o.crd)
    assert node.get("default") == o.schema_default
    assert node.get("minimum") == o.minimum and node.get("maximum") == o.maximum
    assert bool(node.get("exclusiveMinimum")) == o.exclusive_minimum
    assert tuple(node.get("enum", ())) == o.choices
    if o.cli_flag and o.crd_default is options.SAME:
        assert TrainerConfig.parser().get_default(o.name) == o.default
        assert getattr(TrainerConfig(), o.name) == o.default


#: What the CRD said before it was generated from the table: additions only (the maxima on
#: seed, steps, epochs, intervals and lr: issue 20's bounds on every number).
PINNED_BOUNDS = {
    "image": (None, False, None),
    "data_dir": (None, False, None),
    "dataset": (None, False, None),
    "model": (None, False, None),
    "seed": (0, False, 2**32 - 1),
    "steps": (1, False, 1 << 24),
    "epochs": (1, False, 1 << 24),
    "batch_size": (1, False, 65536),
    "eval_every": (0, False, 1 << 24),
    "optimizer": (None, False, None),
    "lr": (0, True, 10.0),
    "lr_decay": (0, False, 1),
    "lr_decay_epochs": (1, False, 1 << 24),
    "ipus_per_worker": (1, False, 64),
    "ipu_memory_mb": (1, False, 65536),
    "variables_on_host": (None, False, None),
    "bucket_mb": (0.001, False, 4096),
    "ring_transport": (None, False, None),
    "ring_step_timeout_s": (0, True, 86400),
    "ring_connect_timeout_s": (0, True, 86400),
    "checkpoint_dir": (None, False, None),
    "checkpoint_every": (0, False, 1 << 24),
    "checkpoint_volume": (None, False, None),
}


def test_the_crd_bounds_did_not_change():
    bounds = {
        name: (o.minimum, o.exclusive_minimum, o.maximum)
        for name, o in options.BY_NAME.items()
        if o.crd
    }
    assert {n: bounds.get(n) for n in PINNED_BOUNDS} == PINNED_BOUNDS


def _worker(trainer: dict) -> tuple[TrainerSpec, TrainerConfig]:
    j = spec.load(job_obj(workers=2, trainer=trainer))
    (c,) = manifests.pod(j, j.replica("worker"), 0)["spec"]["containers"]
    return j.trainer, TrainerConfig.from_args(c["args"], {})


#: valid non-default values for the fields whose pattern a made-up path would not match
PATTERNED = {"model": "/custom/model.keras", "trace_steps": "3-5"}


def _other_value(o: options.Option):
    """A valid value other than the default, with digits that a rounding formatter would lose."""
    if o.name in PATTERNED:
        return PATTERNED[o.name]
    if o.choices:
        return next(c for c in reversed(o.choices) if c != o.default)
    if o.type is bool:
        return not o.default
    if o.type is str:
        return f"/custom/{o.name}"
    if o.type is int:
        return o.default * 2 if o.default else (o.minimum or 0) + 1
    return o.default / 3 if o.default else ((o.minimum or 0) + 1) / 3


def _spec_setting(chosen: list[options.Option]) -> dict:
    trainer: dict = {}
    for o in chosen:
        *parents, leaf = o.crd.split(".")
        node = trainer
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = _other_value(o)
    return trainer


@pytest.mark.parametrize("unset", ["epochs", "steps"])
def test_every_field_reaches_the_worker_as_the_same_value(unset):
    """spec.trainer → trainer_args → the worker's parser, for a value other than the default."""
    passed = [o for o in options.CRD if o.cli_flag and o.name != unset]
    crd_only = {
        "image",
        "checkpoint_volume",
        "data_volume",
        "data_mount_path",
        "data_file",
        "model_from",
    }
    assert {o.name for o in options.CRD if not o.cli_flag} == crd_only
    assert len(passed) == len(options.CRD) - len(crd_only) - 1  # and `unset`
    t, cfg = _worker(_spec_setting(passed))
    assert getattr(cfg, unset) is getattr(t, unset) is None
    for o in passed:
        assert getattr(cfg, o.name) == getattr(t, o.name) == _other_value(o) != o.default, o.name
        assert type(getattr(cfg, o.name)) is type(getattr(t, o.name)), o.name


def test_a_spec_with_only_defaults_runs_the_worker_with_its_own_defaults():
    t, cfg = _worker({})
    bare = TrainerConfig.from_args([], {})
    for o in options.CRD:
        if o.cli_flag and o.crd_default is options.SAME:
            assert getattr(cfg, o.name) == getattr(bare, o.name), o.name
            assert o.default is None or getattr(cfg, o.name) == o.default, o.name
    assert (t.checkpoint_dir, cfg.checkpoint_dir) == ("/checkpoints", "/checkpoints")


@pytest.mark.parametrize(
    "value, text",
    [(30.0, "30"), (0.0123456789, "0.0123456789"), (1e-05, "1e-05"), (64, "64"), ("tcp", "tcp")],
)
def test_flag_values_are_not_rounded(value, text):
    assert optiongen.format_value(value) == text


@pytest.mark.parametrize(
    "o", [o for o in options.WORKER if o.minimum is not None], ids=lambda o: o.name
)
def test_the_worker_refuses_what_is_below_the_tables_minimum(o):
    low = o.minimum if o.exclusive_minimum else o.minimum - 1
    with pytest.raises(InvalidSpec, match=o.cli_flag):
        TrainerConfig.from_args([o.cli_flag, str(o.type(low))], {})
    TrainerConfig.from_args([o.cli_flag, optiongen.format_value(o.type(o.minimum + 1))], {})


def test_nan_is_refused_where_a_number_has_a_minimum():
    with pytest.raises(InvalidSpec, match="--lr must be positive"):
        TrainerConfig.from_args(["--lr", "nan"], {})


def test_the_worker_keeps_its_old_messages():
    for argv, message in [
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--eval-every", "-1"], "--eval-every must not be negative"),
        (["--bucket-mb", "0"], "--bucket-mb must be at least 0.001"),
        (["--ring-step-timeout-s", "0"], "--ring-step-timeout-s must be positive"),
    ]:
        with pytest.raises(InvalidSpec, match=message):
            TrainerConfig.from_args(argv, {})


def test_upper_bounds_are_the_crds_alone():
    """The worker never had upper bounds; a local run may use a larger value than a cluster."""
    cfg = TrainerConfig.from_args(["--ring-step-timeout-s", "100000", "--lr-decay", "2"], {})
    assert (cfg.ring_step_timeout_s, cfg.lr_decay) == (100000.0, 2.0)
    with pytest.raises(InvalidSpec, match=r"spec\.trainer\.ring\.stepTimeoutSeconds"):
        spec.load(job_obj(trainer={"ring": {"stepTimeoutSeconds": 100000}}))
