"""Issue 35, item 5: ``render`` accepted stage names and trace ranges the worker refuses at start.

The rules live once, in ``ringtrain.optionrules``; the worker's ``optiongen.check`` and the
operator's spec check both run them. Each case goes through the real ``ringtrain render`` (exit
2 naming the field) and the real worker parser (``InvalidSpec`` naming the flag), and the two
give the same reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ringtrain import cli
from ringtrain.errors import InvalidSpec
from ringtrain_trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "examples" / "fashion-mnist-2workers.yaml").read_text())

SCHEDULE = ["--pipeline-schedule"]
#: (spec.trainer fields, the same as worker flags)
BAD = {
    "trace 0-3": ({"trace": {"steps": "0-3"}}, ["--trace-steps", "0-3"]),
    "trace 5-4": ({"trace": {"steps": "5-4"}}, ["--trace-steps", "5-4"]),
    "trace 0": ({"trace": {"steps": "0"}}, ["--trace-steps", "0"]),
    "trace 1-1001": ({"trace": {"steps": "1-1001"}}, ["--trace-steps", "1-1001"]),
    "trace 10-5000": ({"trace": {"steps": "10-5000"}}, ["--trace-steps", "10-5000"]),
    "3 names, 2 IPUs": (
        {"ipusPerWorker": 2, "pipeline": {"stages": "a,b,c"}},
        ["--ipus-per-worker", "2", "--pipeline-stages", "a,b,c"],
    ),
    "a name, 1 IPU": (
        {"pipeline": {"stages": "dense"}},
        ["--pipeline-stages", "dense"],
    ),
    "2 names, 4 IPUs": (
        {"ipusPerWorker": 4, "pipeline": {"stages": "a,b"}},
        ["--ipus-per-worker", "4", "--pipeline-stages", "a,b"],
    ),
    "a name twice": (
        {"ipusPerWorker": 4, "pipeline": {"stages": "a, b ,a"}},
        ["--ipus-per-worker", "4", "--pipeline-stages", "a, b ,a"],
    ),
    "Interleaved": (
        {"ipusPerWorker": 2, "pipeline": {"stages": "auto", "schedule": "Interleaved"}},
        ["--ipus-per-worker", "2", "--pipeline-stages", "auto", *SCHEDULE, "Interleaved"],
    ),
}
GOOD = {
    "trace 3-5": ({"trace": {"steps": "3-5"}}, ["--trace-steps", "3-5"]),
    "trace 1000 steps": ({"trace": {"steps": "1-1000"}}, ["--trace-steps", "1-1000"]),
    "1 name, 2 IPUs": (
        {"ipusPerWorker": 2, "pipeline": {"stages": "dense"}},
        ["--ipus-per-worker", "2", "--pipeline-stages", "dense"],
    ),
    "auto, Sequential": (
        {"ipusPerWorker": 2, "pipeline": {"stages": "auto", "schedule": "Sequential"}},
        ["--ipus-per-worker", "2", "--pipeline-stages", "auto", *SCHEDULE, "Sequential"],
    ),
    "Interleaved, no stages": (
        {"pipeline": {"schedule": "Interleaved"}},
        ["--pipeline-schedule", "Interleaved"],
    ),
}


def render(tmp_path: Path, capsys, trainer: dict) -> tuple[int, str]:
    doc = yaml.safe_load(yaml.safe_dump(BASE))
    doc["spec"]["trainer"].update(trainer)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    code = cli.main(["render", str(path)])
    return code, capsys.readouterr().err


def field(trainer: dict) -> str:
    """The spec.trainer field a case is about (the last one it sets)."""
    key, value = list(trainer.items())[-1]
    if isinstance(value, dict):
        return f"spec.trainer.{key}.{list(value)[-1] if key == 'trace' else 'stages'}"
    return f"spec.trainer.{key}"


@pytest.mark.parametrize("case", BAD)
def test_render_refuses_what_the_worker_refuses_for_the_same_reason(tmp_path, capsys, case):
    trainer, flags = BAD[case]
    with pytest.raises(InvalidSpec) as worker:
        TrainerConfig.from_args(flags, env={})
    code, err = render(tmp_path, capsys, trainer)
    assert code == 2, err
    flag, _, why = str(worker.value).partition(" ")
    assert flag in flags
    named = "spec.trainer.pipeline.schedule" if case == "Interleaved" else field(trainer)
    assert f"{named} {why}" in err


@pytest.mark.parametrize("case", GOOD)
def test_what_the_worker_accepts_render_accepts(tmp_path, capsys, case):
    trainer, flags = GOOD[case]
    TrainerConfig.from_args(flags, env={})
    code, err = render(tmp_path, capsys, trainer)
    assert code == 0, err
