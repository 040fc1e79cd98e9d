"""`ringtrain` command line: a thin dispatcher to the module that owns each command.

Each command module exposes ``main(argv: list[str]) -> int`` (or the function named after a
``:``) and parses its own flags, so the
trainer image starts a worker without importing the operator (kopf, kubernetes) and vice versa.
"""

from __future__ import annotations

import difflib
import importlib
import sys

from ringtrain import __version__

#: command words → (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("worker",): (
        "ringtrain_trainer.worker_main:process_main",
        "train as one replica (single worker when TF_CONFIG is unset)",
    ),
    ("run",): ("ringtrain_localrun.cli", "run a TrainingJob manifest as local processes"),
    ("scale",): (
        "ringtrain_localrun.resize",
        "resize a running `ringtrain run` of an elastic job (spec.elasticPolicy)",
    ),
    ("logs",): (
        "ringtrain_client.cli:logs_main",
        "print a job's replica logs (a local run dir, or a cluster job's pods)",
    ),
    ("submit",): (
        "ringtrain_client.submit",
        "start a job from its YAML and return (a cluster's, or local processes)",
    ),
    ("status",): ("ringtrain_client.cli:status_main", "print a job's phase and progress"),
    ("list",): ("ringtrain_client.cli:list_main", "list the jobs (local runs, or a namespace's)"),
    ("wait",): ("ringtrain_client.cli:wait_main", "wait for a job; exit 0 if it succeeded"),
    ("delete",): ("ringtrain_client.cli:delete_main", "stop and delete a job (local: its run dir)"),
    ("render",): ("ringtrain_operator.render", "print every object the operator would create"),
    ("convert",): ("ringtrain_operator.tfjob", "print a Kubeflow TFJob file as a TrainingJob"),
    ("model-configmap",): (
        "ringtrain_operator.modelfrom",
        "print a ConfigMap holding a .keras file, for spec.trainer.modelFrom",
    ),
    ("operator",): ("ringtrain_operator.main", "run the Kubernetes operator (kopf)"),
    ("health",): (
        "ringtrain_trainer.ring.probe",
        "ask a worker's gRPC Health service (the pod probe)",
    ),
    ("export",): ("ringtrain_trainer.export.cli", "write a checkpoint's model as .keras or ONNX"),
    ("data", "inspect"): (
        "ringtrain_trainer.data.cli:inspect_main",
        "what a data set holds: format, files, rows, shapes, dtypes, size",
    ),
    ("data", "convert"): (
        "ringtrain_trainer.data.cli:convert_main",
        "a .npz, TFRecord or Parquet files or an image folder into the .npy shards to train from",
    ),
    ("completion",): ("ringtrain.completion", "print a shell completion script (bash; zsh too)"),
    ("bench", "step"): ("ringtrain_bench.step", "training samples/s vs PyTorch / TensorFlow"),
    ("bench", "allreduce"): ("ringtrain_bench.allreduce", "ring allreduce bandwidth vs gloo / MPI"),
    ("bench", "epoch"): (
        "ringtrain_bench.epoch",
        "one epoch, 2 ring workers vs TensorFlow MultiWorkerMirroredStrategy",
    ),
}


def usage() -> str:
    lines = ["usage: ringtrain <command> [options]", "", "commands:"]
    for words, (_, text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<18} {text}")
    lines.append("")
    lines.append("Run `ringtrain <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for n in (2, 1):
        key = tuple(argv[:n])
        if key in COMMANDS:
            name, _, func = COMMANDS[key][0].partition(":")
            module = importlib.import_module(name)
            return int(getattr(module, func or "main")(argv[n:]) or 0)
    if argv and argv[0] in ("-V", "--version"):
        print(f"ringtrain {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    group = any(len(w) > 1 and w[0] == argv[0] for w in COMMANDS)  # "bench stpe"
    if group and len(argv) > 1 and argv[1] in ("-h", "--help"):  # "ringtrain bench --help"
        print(usage())
        return 0
    given = " ".join(argv[:2] if group else argv[:1])
    near = difflib.get_close_matches(given, [" ".join(w) for w in COMMANDS], n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    print(f"ringtrain: unknown command '{given}'{hint}\n\n{usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
