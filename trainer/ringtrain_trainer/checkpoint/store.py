"""Checkpoints: ``.npz`` arrays (never pickled) plus a JSON manifest carrying their checksum.

Pipeline position: the chief saves a :class:`TrainingState` every ``--checkpoint-every`` steps
and at the end; every worker loads the newest good one at start-up, so a gang recreated by the
operator resumes where it stopped. Each file is written atomically (temporary file, fsync,
rename, fsync of the directory) and the manifest — written last — is the commit record: a
checkpoint without a manifest does not exist. Loading verifies the SHA-256 recorded in the
manifest; a corrupt checkpoint is reported by name and the previous one is used.

Checkpoints are read defensively (issue 20): a forged manifest pointed its ``.npz`` at a FIFO
(the chief hung in ``open``) or a device (``/dev/zero``: read forever), so only regular files
are read, never through a symbolic link, opened non-blocking, and only up to a size cap; the
``.npz`` must be the manifest's own sibling. A checksum-valid checkpoint that does not fit the
run (another model, wrong shapes) is skipped like a corrupt one (``load_latest``'s ``check``),
and so is a forged or non-finite one (issue 35): ``verify`` checks every field and array first.
A write that fails (a full disk) removes its temporary file and names the checkpoint.

What is saved does not depend on the world size (the flat parameters, the optimizer state and
the data position counted in examples), so N workers can resume what M workers wrote.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ringtrain import files
from ringtrain.errors import CheckpointError
from ringtrain_trainer.checkpoint import owner, verify
from ringtrain_trainer.data.dataset import Position

FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{10})\.json$")
#: A manifest is a page of JSON; anything larger is not one.
MAX_MANIFEST_BYTES = 1 << 20


def read_regular(path: Path, cap: int, what: str = "file") -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``cap`` bytes, reached without a
    symbolic link (``files.read_regular``); else a :class:`CheckpointError` naming it."""
    try:
        return files.read_regular(path, cap, what)
    except files.Refused as e:
        raise CheckpointError(str(e)) from None


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
    #: the loss that ran (``engine.loss_spec.LossSpec.record``); None in older checkpoints
    loss_config: dict | None = None
    #: the run's precision (fp16/fp32), so an export keeps an fp16 run's dtype policy; None in
    #: older checkpoints
    precision: str | None = None


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file, fsync, rename over ``path``. On failure (a full
    disk: ENOSPC) the temporary file is removed and a CheckpointError names ``path``, raised
    from the OSError, so that ``errors.exit_code_for`` still finds the exhaustion (retryable)."""
    try:
        files.atomic_write(path, data)
    except OSError as e:
        why = e.strerror or str(e)
        raise CheckpointError(f"{path}: cannot write ({why}); its temporary file removed") from e


def checkpoint_cap(params_bytes: int, state_bytes: int = 0) -> int:
    """The largest ``.npz`` a run of ``params_bytes`` of parameters reads: parameters and up to
    three optimizer slots of their size (Adam keeps two), the model's state, 1 MiB of headers."""
    return 4 * params_bytes + state_bytes + (1 << 20)


def _fit(check: Callable[[TrainingState], None], state: TrainingState) -> None:
    """``check(state)``; what a checkpoint's record can still make a reader's check raise (a
    forged optimizer record it reads a key of) is a :class:`CheckpointError` naming the file."""
    try:
        check(state)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, AttributeError) as e:
        raise CheckpointError(
            f"{state.source}: does not fit this run ({type(e).__name__}: {e})"
        ) from None


class CheckpointManager:
    """Save, list, verify and prune the checkpoints of one directory."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, max_bytes: int | None = None):
        self.dir = Path(directory)
        self.keep = max(1, keep)
        #: the largest ``.npz`` read (None: only what its manifest says it holds)
        self.max_bytes = max_bytes

    def manifests(self) -> list[Path]:
        """Committed checkpoints, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found)]

    def save(self, state: TrainingState) -> Path:
        """Write ``state`` as the newest checkpoint; first renew this process's lease on the
        directory (``owner.confirm``): a chief whose claim was taken over writes nothing."""
        self.dir.mkdir(parents=True, exist_ok=True)
        stem = f"ckpt-{state.step:010d}"
        try:
            owner.confirm(self.dir)
        except OSError as e:  # EMFILE, ENOSPC: named, and retryable (errors.exhausted)
            why = e.strerror or str(e)
            raise CheckpointError(
                f"{self.dir / stem}: cannot renew the directory's lease ({why}); not written"
            ) from e
        arrays = {"params": state.params}
        arrays.update({f"opt_{k}": v for k, v in state.optimizer_state.items()})
        if state.model_state is not None and state.model_state.size:
            arrays["model_state"] = state.model_state
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy stubs: **kwds may hit allow_pickle
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
            "precision": state.precision,
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
        """Load and verify one checkpoint; any problem — unreadable, corrupt, forged, out of
        range, non-finite (``verify``) — is a :class:`CheckpointError` naming it."""
        mp = Path(manifest_path)
        text = read_regular(mp, MAX_MANIFEST_BYTES, "manifest")
        try:
            m = json.loads(text)
            arrays = m["arrays"]
            npz = mp.parent / arrays["file"]
            expected = arrays["sha256"]
            size = int(arrays.get("bytes", -1))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointError(f"{mp}: unreadable manifest ({type(e).__name__}: {e})") from None
        if m.get("format") != FORMAT:
            raise CheckpointError(f"{mp}: format {m.get('format')!r}, this trainer reads {FORMAT}")
        if npz.name != mp.with_suffix(".npz").name or npz.parent != mp.parent:
            raise CheckpointError(
                f"{mp}: names {arrays['file']!r} as its arrays; only its own "
                f"{mp.with_suffix('.npz').name} is read"
            )
        fields = verify.manifest(m, mp)
        if (named := _NAME.match(mp.name)) and int(named.group(1)) != fields["step"]:
            raise CheckpointError(
                f"{mp}: named for step {int(named.group(1))}, says step {fields['step']}"
            )
        cap = size if size >= 0 else self.max_bytes
        if cap is None or (self.max_bytes is not None and cap > self.max_bytes):
            raise CheckpointError(
                f"{mp}: says its arrays are {size} bytes, over the cap of {self.max_bytes}"
            )
        blob = read_regular(npz, cap)
        actual = hashlib.sha256(blob).hexdigest()
        if actual != expected:
            raise CheckpointError(
                f"{npz}: checksum mismatch (manifest {mp.name} says {str(expected)[:12]}…, "
                f"file has {actual[:12]}…): corrupt or partially written"
            )
        loaded = verify.arrays(blob, npz)
        return TrainingState(
            step=fields["step"],
            source=str(npz),
            position=Position(fields["epoch"], fields["batch"], fields["global_batch"]),
            params=loaded["params"],
            optimizer=fields["optimizer"],
            optimizer_state={k[4:]: v for k, v in loaded.items() if k.startswith("opt_")},
            optimizer_iterations=fields["optimizer_iterations"],
            model=fields["model"],
            world_size=fields["world_size"],
            loss=fields["loss"],
            model_state=loaded.get("model_state"),
            optimizer_config=fields["optimizer_config"],
            loss_config=fields["loss_config"],
            precision=fields["precision"],
        )

    def load_latest(
        self, check: Callable[[TrainingState], None] | None = None
    ) -> tuple[TrainingState | None, list[CheckpointError]]:
        """The newest good checkpoint (or None if there is none) and the corrupt ones skipped;
        ``check`` raises :class:`CheckpointError` for a checkpoint that is intact but does not
        fit the run (another model, wrong shapes), which is skipped the same way.

        Raises :class:`CheckpointError` when checkpoints exist but none of them is good:
        silently starting over would throw the run's progress away.
        """
        errors: list[CheckpointError] = []
        for mp in reversed(self.manifests()):
            try:
                state = self.load(mp)
                if check is not None:
                    _fit(check, state)
                return state, errors
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
