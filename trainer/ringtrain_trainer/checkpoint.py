"""Checkpoints: ``.npz`` arrays (never pickled) plus a JSON manifest carrying their checksum.

Pipeline position: the chief saves a :class:`TrainingState` every ``--checkpoint-every`` steps
and at the end; every worker loads the newest good one at start-up, so a gang recreated by the
operator resumes where it stopped. Each file is written atomically (temporary file, fsync,
rename, fsync of the directory) and the manifest — written last — is the commit record: a
checkpoint without a manifest does not exist. Loading verifies the SHA-256 recorded in the
manifest; a corrupt checkpoint is reported by name and the previous one is used.

What is saved does not depend on the world size (the flat parameters, the optimizer state and
the data position counted in examples), so N workers can resume what M workers wrote.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ringtrain.errors import CheckpointError
from ringtrain_trainer.data import Position

FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{10})\.json$")


@dataclass
class TrainingState:
    """Everything needed to continue training exactly."""

    step: int
    position: Position
    params: np.ndarray
    optimizer: str
    optimizer_state: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer_iterations: int = 0
    #: the ``.npz`` it was loaded from (None: in memory), for error messages
    source: str | None = None
    model: str = "cnn"
    world_size: int = 1
    loss: float | None = None
    #: the model's non-trainable state (BatchNormalization's moving statistics), if any
    model_state: np.ndarray | None = None
    #: the optimizer that ran (``optim.OptimizerSpec.record``: Keras serialization, source);
    #: None in checkpoints written before it was recorded
    optimizer_config: dict | None = None
    #: the loss that ran (``engine.losses.LossSpec.record``); None in older checkpoints
    loss_config: dict | None = None


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class CheckpointManager:
    """Save, list, verify and prune the checkpoints of one directory."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3):
        self.dir = Path(directory)
        self.keep = max(1, keep)

    def manifests(self) -> list[Path]:
        """Committed checkpoints, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found)]

    def save(self, state: TrainingState) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = f"ckpt-{state.step:010d}"
        arrays = {"params": state.params}
        arrays.update({f"opt_{k}": v for k, v in state.optimizer_state.items()})
        if state.model_state is not None and state.model_state.size:
            arrays["model_state"] = state.model_state
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        blob = buf.getvalue()
        npz = self.dir / f"{stem}.npz"
        _atomic_write(npz, blob)
        manifest = {
            "format": FORMAT,
            "step": state.step,
            "epoch": state.position.epoch,
            "batch": state.position.batch,
            "global_batch": state.position.global_batch,
            "model": state.model,
            "optimizer": state.optimizer,
            "optimizer_iterations": state.optimizer_iterations,
            "optimizer_config": state.optimizer_config,
            "loss_config": state.loss_config,
            "world_size": state.world_size,
            "loss": state.loss,
            "arrays": {
                "file": npz.name,
                "sha256": hashlib.sha256(blob).hexdigest(),
                "bytes": len(blob),
                "names": sorted(arrays),
            },
        }
        path = self.dir / f"{stem}.json"
        _atomic_write(path, json.dumps(manifest, indent=1).encode())
        self._prune()
        return path

    def _prune(self) -> None:
        for old in self.manifests()[: -self.keep]:
            npz = old.with_suffix(".npz")
            old.unlink(missing_ok=True)
            npz.unlink(missing_ok=True)

    def load(self, manifest_path: str | os.PathLike) -> TrainingState:
        """Load and verify one checkpoint; any problem is a :class:`CheckpointError` naming it."""
        mp = Path(manifest_path)
        try:
            m = json.loads(mp.read_text())
            arrays = m["arrays"]
            npz = mp.parent / arrays["file"]
            expected = arrays["sha256"]
            step = int(m["step"])
        except FileNotFoundError:
            raise CheckpointError(f"{mp}: manifest does not exist") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{mp}: unreadable manifest ({type(e).__name__}: {e})") from None
        if m.get("format") != FORMAT:
            raise CheckpointError(f"{mp}: format {m.get('format')!r}, this trainer reads {FORMAT}")
        try:
            blob = npz.read_bytes()
        except OSError as e:
            raise CheckpointError(f"{npz}: cannot read ({e})") from None
        actual = hashlib.sha256(blob).hexdigest()
        if actual != expected:
            raise CheckpointError(
                f"{npz}: checksum mismatch (manifest {mp.name} says {expected[:12]}…, "
                f"file has {actual[:12]}…): corrupt or partially written"
            )
        try:
            with np.load(io.BytesIO(blob), allow_pickle=False) as z:
                loaded = {k: z[k] for k in z.files}
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{npz}: not a valid .npz ({e})") from None
        if "params" not in loaded:
            raise CheckpointError(f"{npz}: no 'params' array")
        return TrainingState(
            step=step,
            source=str(npz),
            position=Position(int(m["epoch"]), int(m["batch"]), int(m["global_batch"])),
            params=loaded["params"],
            optimizer=m["optimizer"],
            optimizer_state={k[4:]: v for k, v in loaded.items() if k.startswith("opt_")},
            optimizer_iterations=int(m["optimizer_iterations"]),
            model=m["model"],
            world_size=int(m["world_size"]),
            loss=m.get("loss"),
            model_state=loaded.get("model_state"),
            optimizer_config=m.get("optimizer_config"),
            loss_config=m.get("loss_config"),
        )

    def load_latest(self) -> tuple[TrainingState | None, list[CheckpointError]]:
        """The newest good checkpoint (or None if there is none) and the corrupt ones skipped.

        Raises :class:`CheckpointError` when checkpoints exist but none of them is good:
        silently starting over would throw the run's progress away.
        """
        errors: list[CheckpointError] = []
        for mp in reversed(self.manifests()):
            try:
                return self.load(mp), errors
            except CheckpointError as e:
                errors.append(e)
        if errors:
            raise CheckpointError(
                f"{self.dir}: no usable checkpoint: " + "; ".join(str(e) for e in errors)
            )
        return None, errors

    @staticmethod
    def require_model_state(state: TrainingState, spec) -> np.ndarray:
        """The non-trainable state ``spec`` (a ``model.ModelSpec``) needs, from ``state``.

        Every reader (resume, the evaluator, export) goes through here, so none of them runs a
        BatchNormalization model with fresh moving statistics — the evaluator once reported ≈10 %
        for a 74 % model that way. A checkpoint without the state is refused, naming the file, the
        missing array and what the model needs it for."""
        if not spec.state_size:
            return spec.init_state()
        got = state.model_state
        if got is not None and got.shape == (spec.state_size,):
            return got
        needs = ", ".join(
            f"{getattr(layer, 'name', f'layer {i}')}.{name}"
            for i, (layer, specs) in enumerate(zip(spec.layers, spec.state_specs, strict=True))
            for name, _, _ in specs
        )
        have = "no 'model_state' array" if got is None else f"'model_state' of shape {got.shape}"
        raise CheckpointError(
            f"{state.source or 'checkpoint'}: {have}, but model {spec.name!r} needs "
            f"{spec.state_size} values of non-trainable state ({needs}); refusing to use fresh "
            "statistics in their place"
        )
