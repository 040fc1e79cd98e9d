"""The trainer's configuration, read once at the edge (flags + environment) and passed down.

The flags, their defaults and bounds are the option table of ``ringtrain.options`` (listed in
docs/reference.md); the environment supplies TF_CONFIG, the ring token and the directory of the
job's TLS material (``RINGTRAIN_TLS_DIR``, like ``RINGTRAIN_TOKEN_FILE`` a path into the mounted
Secret, never the key itself) and a forced kernel set (``RINGTRAIN_KERNELS``: checked here against
this CPU, applied by the :class:`~ringtrain_trainer.worker.Trainer`). Nothing below this module
reads ``os.environ`` or ``sys.argv``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringtrain import cluster, optiongen, options, pki
from ringtrain.errors import InvalidSpec
from ringtrain_trainer import elastic, trace
from ringtrain_trainer.engine import native

DEFAULT_TERMINATION_LOG = options.TERMINATION_LOG


@dataclass(frozen=True)
class TrainerConfig(options.TrainerOptions):
    """Every option of ``ringtrain.options`` (fields, defaults) plus what the environment gives."""

    cluster: cluster.ClusterSpec = field(default_factory=cluster.ClusterSpec.single)
    token: bytes = b""
    tls: pki.JobMaterial | None = field(default=None, repr=False)
    #: an elastic job's size file (:mod:`.elastic`) and what it held at start-up
    elastic_file: str | None = None
    elastic_size: str = ""
    #: the kernel set ``RINGTRAIN_KERNELS`` forces (``engine.native.force``); "": the widest
    kernels: str = ""

    def replace(self, **changes: Any) -> TrainerConfig:
        """A copy with ``changes`` by option name: ``dataclasses.replace``, through a signature
        mypy accepts (it cannot see the fields ``ringtrain.options`` generates)."""
        return dataclasses.replace(self, **changes)

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * (1 << 20)))

    @property
    def trace_window(self) -> tuple[int, int] | None:
        return trace.parse_steps(self.trace_steps)

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        return optiongen.parser("ringtrain worker", "Train as one replica of a ringtrain job.")

    @classmethod
    def from_args(cls, argv: list[str], env: Mapping[str, str] | None = None) -> TrainerConfig:
        """Parse flags and the environment; every invalid value raises :class:`InvalidSpec`."""
        env = os.environ if env is None else env
        values = vars(cls.parser().parse_args(argv))
        optiongen.check(values)  # the trace window and pipeline rules too (optionrules)
        if values["epochs"] is None and values["steps"] is None:
            values["epochs"] = 1
        size = elastic.read(env[elastic.ENV]) if env.get(elastic.ENV) else None
        if size is not None:  # an elastic job's current size wins over the pod's environment
            values["batch_size"] = size.batch_size
        spec = cluster.parse(size.tf_config if size else env.get("TF_CONFIG"))
        token = b""
        if env.get("RINGTRAIN_TOKEN_FILE"):
            path = Path(env["RINGTRAIN_TOKEN_FILE"])
            try:
                token = path.read_bytes().strip()
            except OSError as e:
                raise InvalidSpec(f"RINGTRAIN_TOKEN_FILE {path}: cannot read ({e})") from None
        elif env.get("RINGTRAIN_TOKEN"):
            token = env["RINGTRAIN_TOKEN"].encode()
        if values["metrics_port"] is not None and values["metrics_port"] > 65535:
            raise InvalidSpec(f"--metrics-port {values['metrics_port']} is not a TCP port")
        if not token and values["collective"] == "ring" and spec.in_ring and spec.world_size > 1:
            raise InvalidSpec(
                "RINGTRAIN_TOKEN_FILE (or RINGTRAIN_TOKEN): a ring of "
                f"{spec.world_size} members needs the job's token; without one "
                "any process could join it"
            )
        tls_dir = values["ring_tls_dir"] or env.get("RINGTRAIN_TLS_DIR") or None
        values["ring_tls_dir"] = tls_dir
        tls = pki.load(tls_dir) if tls_dir else None  # InvalidSpec names the file
        if values["termination_log"] is None and _writable(DEFAULT_TERMINATION_LOG):
            values["termination_log"] = DEFAULT_TERMINATION_LOG
        return cls(
            **values,
            cluster=spec,
            token=token,
            tls=tls,
            elastic_file=env.get(elastic.ENV) or None,
            elastic_size=size.raw if size else "",
            kernels=native.chosen(env.get(native.ENV, "")),
        )


def _writable(path: str) -> bool:
    """Kubernetes creates the termination log file; never create it outside a pod."""
    p = Path(path)
    return p.is_file() and os.access(p, os.W_OK)


def layer_names(text: str | None) -> tuple[str, ...]:
    """A comma-separated list of Keras layer names (``recomputationCheckpoints``,
    ``pipeline.stages``) as the option table carries it: one string."""
    return tuple(n.strip() for n in (text or "").split(",") if n.strip())
