"""Forged but checksum-valid checkpoints, and non-finite ones, fall back to the previous good
checkpoint with a message naming the file — never a traceback, never a resume (issue 35).

Before: the checksum was all that was checked. Complex, integer or 2-D parameters, a negative or
absurd step, a missing key were loaded (and crashed the resume in a copy, or resumed); ``"step":
"abc"`` or ``1e400`` was a ``ValueError``/``OverflowError`` traceback out of ``load_latest``; a
``.npy`` header declaring 10^12 floats made numpy allocate them; a NaN checkpoint was resumed
rather than the previous good one. The property test below generates such checkpoints
(``hypothesis``, derandomized, 50 examples) and asserts the invariant for each."""

from __future__ import annotations

import hashlib
import io
import json
import warnings
import zipfile

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fuzz import fuzz

from ringtrain.errors import CheckpointError
from ringtrain.options import MAX_STEPS
from ringtrain_trainer.checkpoint.store import CheckpointManager, TrainingState
from ringtrain_trainer.data.dataset import Position

N = 500
FORGED = "ckpt-0000000004"


def good(step: int) -> TrainingState:
    rng = np.random.default_rng(step)
    return TrainingState(
        step=step,
        position=Position(0, step, 64),
        params=rng.random(N).astype(np.float32),
        optimizer="adam",
        optimizer_state={
            "m": np.zeros(N, np.float32),
            "v": np.zeros(N, np.float32),
            "loss_scale": np.array([2.0**15, 3], np.float64),
        },
        optimizer_iterations=step,
        model_state=np.ones(8, np.float32),
    )


def savez(arrays: dict, compressed: bool = False) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def declared(name: str, shape: tuple, descr: str = "<f4", data: bytes = b"") -> bytes:
    """A zip whose ``name`` member's ``.npy`` header declares ``shape`` over ``data``."""
    npy = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        npy, {"descr": descr, "fortran_order": False, "shape": shape}
    )
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("params.npy", _npy(np.zeros(N, np.float32)))
        z.writestr(name, npy.getvalue() + data)
    return out.getvalue()


def _npy(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def manifest(blob: bytes, **fields) -> dict:
    m = {
        "format": 1,
        "step": 4,
        "epoch": 0,
        "batch": 4,
        "global_batch": 64,
        "model": "cnn",
        "optimizer": "adam",
        "optimizer_iterations": 4,
        "optimizer_config": None,
        "loss_config": None,
        "precision": None,
        "world_size": 1,
        "loss": 0.5,
        "arrays": {
            "file": f"{FORGED}.npz",
            "sha256": hashlib.sha256(blob).hexdigest(),
            "bytes": len(blob),
            "names": [],
        },
    }
    for k, v in fields.items():
        if v is DELETE:
            del m[k]
        else:
            m[k] = v
    return m


DELETE = object()


def plant(ck, blob: bytes, text: str | None = None, **fields) -> None:
    (ck / f"{FORGED}.npz").write_bytes(blob)
    (ck / f"{FORGED}.json").write_text(
        text if text is not None else json.dumps(manifest(blob, **fields))
    )


def arrays_of(state: TrainingState, **over) -> dict:
    a = {"params": state.params, "model_state": state.model_state}
    a.update({f"opt_{k}": v for k, v in state.optimizer_state.items()})
    for k, v in over.items():
        if v is DELETE:
            del a[k]
        else:
            a[k] = v
    return a


def with_nan(a: np.ndarray, at: int = 7, value: float = np.nan) -> np.ndarray:
    a = a.copy()
    a[at] = value
    return a


S = good(4)
CASES = {
    "complex params": (arrays_of(S, params=S.params.astype(np.complex64)), {}, "complex64"),
    "int params": (arrays_of(S, params=np.arange(N)), {}, "int64"),
    "object params": (arrays_of(S, params=np.array([{}] * 3, object)), {}, "object"),
    "bool params": (arrays_of(S, params=np.ones(N, bool)), {}, "bool"),
    "2-D params": (arrays_of(S, params=S.params.reshape(5, 100)), {}, "shape (5, 100)"),
    "no params": (arrays_of(S, params=DELETE), {}, "no 'params' array"),
    "extra array": (arrays_of(S, junk=np.zeros(3, np.float32)), {}, "holds 'junk.npy'"),
    "bad loss scale": (
        arrays_of(S, opt_loss_scale=np.array([-1.0, 0.0])),
        {},
        "loss scale [-1.0, 0.0]",
    ),
    "negative step": (arrays_of(S), {"step": -5}, "'step' is -5, outside [0, "),
    "step not its name's": (arrays_of(S), {"step": 3}, "named for step 4, says step 3"),
    "absurd step": (arrays_of(S), {"step": 10**30}, "'step' is 1000000000000000000000000000000"),
    "step 2^24": (arrays_of(S), {"step": MAX_STEPS + 1}, f"'step' is {MAX_STEPS + 1}"),
    "string step": (arrays_of(S), {"step": "abc"}, "'step' is str 'abc', not an integer"),
    "float epoch": (arrays_of(S), {"epoch": 1.5}, "'epoch' is float 1.5"),
    "negative position": (arrays_of(S), {"batch": -1}, "'batch' is -1"),
    "zero world": (arrays_of(S), {"world_size": 0}, "'world_size' is 0"),
    "missing optimizer": (arrays_of(S), {"optimizer": DELETE}, "'optimizer' is missing"),
    "list optimizer record": (arrays_of(S), {"optimizer_config": [1]}, "'optimizer_config'"),
    "bad optimizer record": (
        arrays_of(S),
        {"optimizer_config": {"name": "adam"}},
        "not an optimizer's record",
    ),
    "string loss": (arrays_of(S), {"loss": "low"}, "'loss' is str"),
    "NaN params": (arrays_of(S, params=with_nan(S.params)), {}, "non-finite params: 1 of 500"),
    "inf params": (
        arrays_of(S, params=with_nan(S.params, 0, np.inf)),
        {},
        "(the first, index 0, is inf)",
    ),
    "NaN optimizer state": (
        arrays_of(S, opt_v=with_nan(S.optimizer_state["v"])),
        {},
        "non-finite optimizer state 'v'",
    ),
    "NaN model state": (
        arrays_of(S, model_state=with_nan(S.model_state, 2)),
        {},
        "non-finite model state",
    ),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_forged_or_non_finite_checkpoint_falls_back_to_the_previous_good_one(tmp_path, case):
    arrays, fields, want = CASES[case]
    ck = tmp_path
    mgr = CheckpointManager(ck, keep=5)
    mgr.save(good(2))
    plant(ck, savez(arrays), **fields)
    got, skipped = mgr.load_latest()
    assert got is not None and got.step == 2
    assert len(skipped) == 1 and FORGED in str(skipped[0]), skipped
    assert want in str(skipped[0]), str(skipped[0])


HUGE = {
    "declared 10^12 floats": (declared("opt_m.npy", (10**12,)), "its header says (1000000000000,)"),
    "declared complex": (declared("opt_m.npy", (2,), "<c8", b"\0" * 16), "complex64"),
    "declared object": (declared("opt_m.npy", (2,), "|O", b"\0" * 16), "object"),
    "a zip bomb": (
        savez({"params": np.zeros(N, np.float32), "opt_m": np.zeros(1 << 24, np.float32)}, True),
        "compressed",
    ),
    "not a zip": (b"PK\3\4 not really", "not a valid .npz"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(HUGE))
def test_arrays_are_checked_on_their_headers_before_anything_is_allocated(tmp_path, case):
    blob, want = HUGE[case]
    mgr = CheckpointManager(tmp_path, keep=5, max_bytes=1 << 20)
    mgr.save(good(2))
    plant(tmp_path, blob)
    got, skipped = mgr.load_latest()
    assert got is not None and got.step == 2
    assert len(skipped) == 1 and FORGED in str(skipped[0]), skipped
    assert want in str(skipped[0]), str(skipped[0])


@pytest.mark.parametrize("text", ["[1, 2]", '{"format": 1}', '"x"', '{"format": 1, "step": 1e400'])
def test_a_manifest_that_is_not_one_falls_back(tmp_path, text):
    mgr = CheckpointManager(tmp_path, keep=5)
    mgr.save(good(2))
    plant(tmp_path, savez(arrays_of(S)), text=text)
    got, skipped = mgr.load_latest()
    assert got is not None and got.step == 2 and FORGED in str(skipped[0])


def test_a_step_of_1e400_is_named_not_an_overflow_traceback(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=5)
    mgr.save(good(2))
    blob = savez(arrays_of(S))
    text = json.dumps(manifest(blob)).replace('"step": 4', '"step": 1e400')
    plant(tmp_path, blob, text=text)
    got, skipped = mgr.load_latest()
    assert got is not None and got.step == 2
    assert "'step' is float inf, not an integer" in str(skipped[0])


def test_a_reader_check_tripping_on_a_forged_record_is_a_named_fallback(tmp_path):
    """What a checksum-valid record can still make a reader's ``check`` raise (a KeyError
    reading an optimizer record) is a CheckpointError naming the file."""
    mgr = CheckpointManager(tmp_path, keep=5)
    mgr.save(good(2))
    plant(tmp_path, savez(arrays_of(S)))

    def check(state: TrainingState) -> None:
        if state.step == 4:
            raise KeyError("class_name")

    got, skipped = mgr.load_latest(check)
    assert got is not None and got.step == 2
    assert f"{FORGED}.npz: does not fit this run (KeyError" in str(skipped[0])


# -- the property: any forged checkpoint is a named fallback or a sane checkpoint ------------

ANY_JSON = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
FIELDS = [
    "format",
    "step",
    "epoch",
    "batch",
    "global_batch",
    "model",
    "optimizer",
    "optimizer_iterations",
    "optimizer_config",
    "loss_config",
    "precision",
    "world_size",
    "loss",
]
DTYPES = ["float32", "float16", "float64", "complex64", "int32", "uint8", "bool", "object"]
NAMES = ["params", "model_state", "opt_m", "opt_v", "opt_loss_scale", "junk", "opt_", "params2"]


@st.composite
def forged_arrays(draw) -> dict:
    arrays = arrays_of(S)
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(NAMES))
        action = draw(st.sampled_from(["dtype", "shape", "delete", "nonfinite", "value"]))
        a = arrays.get(name, np.zeros(4, np.float32))
        if action == "delete":
            arrays.pop(name, None)
        elif action == "dtype":
            dtype = draw(st.sampled_from(DTYPES))
            with warnings.catch_warnings():  # complex to real: the imaginary part dropped
                warnings.simplefilter("ignore")
                arrays[name] = a.astype(dtype) if dtype != "object" else np.array([None] * 3)
        elif action == "shape":
            shape = draw(st.sampled_from([(), (0,), (2, a.size // 2 or 1), (1, 1, 1)]))
            arrays[name] = np.zeros(shape, a.dtype)
        elif action == "nonfinite" and a.dtype.kind == "f" and a.size:
            a = a.copy()
            a[draw(st.integers(0, a.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
            arrays[name] = a
        else:
            arrays[name] = np.full(max(a.size, 1), draw(st.floats(-1e6, 1e6)), np.float64)
    return arrays


@fuzz(50)
@given(
    arrays=forged_arrays(),
    fields=st.dictionaries(
        st.sampled_from(FIELDS), st.one_of(st.just(DELETE), ANY_JSON), max_size=3
    ),
    compressed=st.booleans(),
)
def test_property_any_forged_checkpoint_is_a_named_fallback_or_a_sane_one(
    tmp_path_factory, arrays, fields, compressed
):
    ck = tmp_path_factory.mktemp("forged")
    mgr = CheckpointManager(ck, keep=5, max_bytes=1 << 20)
    mgr.save(good(2))
    plant(ck, savez(arrays, compressed), **fields)

    def check(state: TrainingState) -> None:  # as the worker's _fits does for the model
        if state.params.shape != (N,):
            raise CheckpointError(f"{state.source}: shape {state.params.shape}")

    try:
        got, skipped = mgr.load_latest(check)
    except CheckpointError as e:  # never: step 2 is good
        raise AssertionError(f"no fallback: {e}") from e
    assert got is not None
    if got.step == 2:
        assert len(skipped) == 1 and FORGED in str(skipped[0]), skipped
        return
    # accepted: then it is sane
    assert got.step == 4 and not skipped
    for a in [got.params, got.model_state, *got.optimizer_state.values()]:
        if a is not None:
            assert a.ndim == 1 and a.dtype.kind == "f" and np.isfinite(a).all()
    p = got.position
    for v in (got.step, p.epoch, p.batch, got.optimizer_iterations):
        assert isinstance(v, int) and 0 <= v <= MAX_STEPS
    assert isinstance(got.model, str) and isinstance(got.optimizer, str)


# -- a real worker ------------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["NaN params", "complex params", "absurd step"])
def test_a_worker_resumes_the_previous_good_checkpoint_not_a_forged_or_nan_one(tmp_path, kind):
    """A real worker's newest checkpoint (step 4) is replaced by a checksum-valid forgery of
    it; the resume names the file on stderr and starts from step 3 (before: a NaN one was
    resumed, the others ended in a traceback)."""
    import subprocess

    from support.procs import WORKER, without_cluster

    ck = tmp_path / "ck"
    args = [*WORKER, "--dataset", "mnist-5k", "--batch-size", "16", "--seed", "3"]
    args += ["--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--json"]

    def run(steps: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*args, "--steps", str(steps)],
            capture_output=True,
            text=True,
            timeout=200,
            env=without_cluster(),
        )

    first = run(4)
    assert first.returncode == 0, first.stderr[-2000:]
    mgr = CheckpointManager(ck)
    real = mgr.load(ck / f"{FORGED}.json")
    arrays = arrays_of(real)
    fields: dict = {}
    if kind == "NaN params":
        arrays["params"] = with_nan(real.params, 11)
    elif kind == "complex params":
        arrays["params"] = real.params.astype(np.complex64)
    else:
        fields["epoch"] = 10**30
    m = json.loads((ck / f"{FORGED}.json").read_text())
    blob = savez({k: v for k, v in arrays.items() if v is not None})
    m["arrays"].update(sha256=hashlib.sha256(blob).hexdigest(), bytes=len(blob))
    m.update(fields)
    (ck / f"{FORGED}.npz").write_bytes(blob)
    (ck / f"{FORGED}.json").write_text(json.dumps(m))
    resumed = run(6)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Traceback" not in resumed.stderr
    assert f"skipping corrupt checkpoint: {ck / FORGED}" in resumed.stderr, resumed.stderr[-2000:]
    steps = [json.loads(x).get("step") for x in resumed.stdout.splitlines() if x.startswith("{")]
    assert steps[0] == 3, resumed.stdout[:500]
