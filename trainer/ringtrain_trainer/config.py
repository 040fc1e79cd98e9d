"""The trainer's configuration, read once at the edge (flags + environment) and passed down.

Flags are exactly those of ``ringtrain worker`` in docs/contracts.md; the environment supplies
TF_CONFIG and the ring token. Nothing below this module reads ``os.environ`` or ``sys.argv``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

# ``ring`` for its defaults only: importing it loads no gRPC (that happens on connect)
from ringtrain import cluster
from ringtrain_trainer import ring
from ringtrain_trainer.data import DATASETS, FASHION_MNIST_DIR
from ringtrain.errors import InvalidSpec
from ringtrain_trainer.model import MODELS
from ringtrain_trainer.optim import OPTIMIZERS

DEFAULT_TERMINATION_LOG = "/dev/termination-log"


@dataclass(frozen=True)
class TrainerConfig:
    data_dir: str = FASHION_MNIST_DIR
    dataset: str = "fashion-mnist"
    model: str = "cnn"
    epochs: int | None = None
    steps: int | None = None
    batch_size: int = 64
    optimizer: str = "adam"
    lr: float = 1e-3
    lr_decay: float = 1.0
    lr_decay_epochs: int = 1
    seed: int = 0
    ipus_per_worker: int = 1
    ipu_memory_mb: int = 900
    ipu_host_threads: int = 0
    variables_on_host: bool = True
    bucket_mb: float = 25.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 3
    eval_every: int = 0
    metrics_port: int = 0
    collective: str = "ring"
    ring_transport: str = "tcp"
    ring_step_timeout_s: float = ring.DEFAULT_STEP_TIMEOUT_S
    ring_connect_timeout_s: float = ring.DEFAULT_CONNECT_TIMEOUT_S
    json: bool = False
    termination_log: str | None = None
    cluster: cluster.ClusterSpec = field(default_factory=cluster.ClusterSpec.single)
    token: bytes = b""

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * (1 << 20)))

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="ringtrain worker",
                                    description="Train as one replica of a ringtrain job.")
        a = p.add_argument
        a("--data-dir", default=FASHION_MNIST_DIR, help="directory of MNIST-format IDX files")
        a("--dataset", default="fashion-mnist", choices=DATASETS)
        a("--model", default="cnn", metavar="NAME_OR_PATH",
          help=f"a preset ({', '.join(MODELS)}), a .json file of model.to_json(), or a .keras file")
        stop = p.add_mutually_exclusive_group()
        stop.add_argument("--epochs", type=int, default=None,
                          help="stop after N epochs (default 1)")
        stop.add_argument("--steps", type=int, default=None, help="stop after N optimizer steps")
        a("--batch-size", type=int, default=64, help="per-worker batch size")
        a("--optimizer", default="adam", choices=OPTIMIZERS)
        a("--lr", type=float, default=1e-3)
        a("--lr-decay", type=float, default=1.0, help="multiply the rate by this every ...")
        a("--lr-decay-epochs", type=int, default=1, help="... this many epochs")
        a("--seed", type=int, default=0)
        a("--ipus-per-worker", type=int, default=1)
        a("--ipu-memory-mb", type=int, default=900)
        a("--ipu-host-threads", type=int, default=0,
          help="host threads emulating the IPU's tiles (0: the CPUs this process may use)")
        a("--no-variables-on-host", dest="variables_on_host", action="store_false",
          help="keep weights and optimizer state on the IPU")
        a("--bucket-mb", type=float, default=25.0, help="gradient fusion bucket size (MiB)")
        a("--checkpoint-dir", default=None)
        a("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: end only)")
        a("--eval-every", type=int, default=0, help="steps between evaluations (0: end only)")
        a("--metrics-port", type=int, default=0, help="serve /metrics and /status (0: off)")
        a("--collective", default="ring", choices=("ring", "mpi"))
        a("--ring-transport", default="tcp", choices=ring.TRANSPORTS,
          help="ring data path: raw TCP (HMAC-authenticated) or all-gRPC; the same on every "
               "worker of a job")
        a("--ring-step-timeout-s", type=float, default=ring.DEFAULT_STEP_TIMEOUT_S,
          help="a collective fails (exit 138) when a peer is silent this long")
        a("--ring-connect-timeout-s", type=float,
          default=ring.DEFAULT_CONNECT_TIMEOUT_S,
          help="how long peers that are not up yet are retried at start-up")
        a("--json", action="store_true", help="one JSON object per line on stdout")
        a("--termination-log", default=None,
          help=f"file for the final JSON result (default {DEFAULT_TERMINATION_LOG} if writable)")
        return p

    @classmethod
    def from_args(cls, argv: list[str], env: Mapping[str, str] | None = None) -> "TrainerConfig":
        """Parse flags and the environment; every invalid value raises :class:`InvalidSpec`."""
        env = os.environ if env is None else env
        ns = cls.parser().parse_args(argv)
        for name in ("batch_size", "ipus_per_worker", "ipu_memory_mb", "lr_decay_epochs"):
            if getattr(ns, name) < 1:
                raise InvalidSpec(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("epochs", "steps"):
            if getattr(ns, name) is not None and getattr(ns, name) < 1:
                raise InvalidSpec(f"--{name} must be at least 1")
        for name in ("checkpoint_every", "eval_every", "metrics_port", "ipu_host_threads"):
            if getattr(ns, name) < 0:
                raise InvalidSpec(f"--{name.replace('_', '-')} must not be negative")
        if ns.lr <= 0 or ns.bucket_mb <= 0:
            raise InvalidSpec("--lr and --bucket-mb must be positive")
        for name in ("ring_step_timeout_s", "ring_connect_timeout_s"):
            if not getattr(ns, name) > 0:  # also refuses nan
                raise InvalidSpec(f"--{name.replace('_', '-')} must be positive")
        if ns.epochs is None and ns.steps is None:
            ns.epochs = 1
        try:
            spec = cluster.parse(env.get("TF_CONFIG"))
        except cluster.InvalidClusterSpec as e:
            raise InvalidSpec(str(e)) from None
        token = b""
        if env.get("RINGTRAIN_TOKEN_FILE"):
            path = Path(env["RINGTRAIN_TOKEN_FILE"])
            try:
                token = path.read_bytes().strip()
            except OSError as e:
                raise InvalidSpec(f"RINGTRAIN_TOKEN_FILE {path}: cannot read ({e})") from None
        elif env.get("RINGTRAIN_TOKEN"):
            token = env["RINGTRAIN_TOKEN"].encode()
        termination_log = ns.termination_log
        if termination_log is None and _writable(DEFAULT_TERMINATION_LOG):
            termination_log = DEFAULT_TERMINATION_LOG
        return cls(
            data_dir=ns.data_dir, dataset=ns.dataset, model=ns.model, epochs=ns.epochs,
            steps=ns.steps, batch_size=ns.batch_size, optimizer=ns.optimizer, lr=ns.lr,
            lr_decay=ns.lr_decay, lr_decay_epochs=ns.lr_decay_epochs, seed=ns.seed,
            ipus_per_worker=ns.ipus_per_worker, ipu_memory_mb=ns.ipu_memory_mb,
            ipu_host_threads=ns.ipu_host_threads,
            variables_on_host=ns.variables_on_host, bucket_mb=ns.bucket_mb,
            checkpoint_dir=ns.checkpoint_dir, checkpoint_every=ns.checkpoint_every,
            eval_every=ns.eval_every, metrics_port=ns.metrics_port, collective=ns.collective,
            ring_transport=ns.ring_transport, ring_step_timeout_s=ns.ring_step_timeout_s,
            ring_connect_timeout_s=ns.ring_connect_timeout_s, json=ns.json, termination_log=termination_log, cluster=spec, token=token,
        )


def _writable(path: str) -> bool:
    """Kubernetes creates the termination log file; never create it outside a pod."""
    p = Path(path)
    return p.is_file() and os.access(p, os.W_OK)
