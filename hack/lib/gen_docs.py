#!/usr/bin/env python3
"""Write docs/reference.md: the TrainingJob fields, the worker's flags, the metrics, the exit codes
and the commands; and docs/tutorial.md, the tutorial notebook as a page (hack/lib/notebook_page.py).

    .venv/bin/python hack/gen-docs            # rewrite docs/reference.md
    .venv/bin/python hack/gen-docs --check    # exit 1 with a unified diff when it is stale
    .venv/bin/python hack/gen-docs --undocumented   # CRD fields that have no description

Why generated: a hand-written reference drifts the day someone adds a field. Every table here is
read from the thing it describes — the CRD's openAPIV3Schema (the same file the operator, the
chart, `ringtrain run` and `ringtrain render` use), the real metric registries of the trainer and
the operator, the option table of trainer/ringtrain/options.py, the exit-code constants and
exception classes of trainer/ringtrain/errors.py, and the command table of trainer/ringtrain/cli.py
— so a new field, flag, metric or command shows up by re-running this, and tests/docs/test_docs.py
fails while the committed file is behind.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "reference.md"
CRD = ROOT / "operator" / "ringtrain_operator" / "crd" / "trainingjobs.yaml"
ERRORS = ROOT / "trainer" / "ringtrain" / "errors.py"

try:
    import yaml
    from prometheus_client import CollectorRegistry
except ImportError:  # run as `hack/gen-docs` with a bare python3: use the project's virtualenv
    venv_python = ROOT / ".venv" / "bin" / "python"
    if venv_python.exists() and Path(sys.prefix).resolve() != venv_python.parent.parent.resolve():
        os.execv(venv_python, [str(venv_python), __file__, *sys.argv[1:]])
    raise

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hack/lib, as `hack/gen-docs` runs it
import notebook_page  # noqa: E402  (after the re-exec into the virtualenv)

#: Suffixes Prometheus adds to a family's name in the exposition, by metric type.
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": (),
}


# --- the TrainingJob reference ---------------------------------------------------------------


@dataclass(frozen=True)
class FieldRow:
    """One field of the schema, already phrased for the table."""

    path: str
    type: str
    required: bool
    default: str
    allowed: str
    description: str


def _code(value) -> str:
    """A schema value as inline code: JSON spelling, so `true`, `{}`, `"…"`-free strings."""
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def _type(node: dict) -> str:
    if "type" not in node and node.get("x-kubernetes-preserve-unknown-fields"):
        return "string or object"  # options.Option.or_object: spec.py checks the value
    kind = node.get("type", "any")
    if kind == "array":
        return f"array of {_type(node.get('items', {}))}"
    if node.get("format"):
        return f"{kind} ({node['format']})"
    return kind


def _allowed(node: dict) -> str:
    """Enum, numeric range, length and pattern constraints in words."""
    parts = []
    if "enum" in node:
        parts.append(", ".join(_code(v) for v in node["enum"]))
    lo, hi = node.get("minimum"), node.get("maximum")
    lo_op = ">" if node.get("exclusiveMinimum") else "≥"
    hi_op = "<" if node.get("exclusiveMaximum") else "≤"
    if lo is not None and hi is not None and lo_op == "≥" and hi_op == "≤":
        parts.append(f"{lo}–{hi}")
    else:
        if lo is not None:
            parts.append(f"{lo_op} {lo}")
        if hi is not None:
            parts.append(f"{hi_op} {hi}")
    if node.get("minLength") == 1 and "maxLength" not in node:
        parts.append("non-empty")
    elif "minLength" in node or "maxLength" in node:
        parts.append(f"length {node.get('minLength', 0)}–{node.get('maxLength', '∞')}")
    if "pattern" in node:
        parts.append(f"matches `{node['pattern']}`")
    if "type" not in node and node.get("x-kubernetes-preserve-unknown-fields"):
        parts.append("checked by the operator (spec.py), not the schema")
    elif node.get("x-kubernetes-preserve-unknown-fields") and not node.get("properties"):
        parts.append("any fields")
    return "; ".join(parts)


def field_rows(schema: dict, prefix: str = "", required: bool = False) -> list[FieldRow]:
    """Every field below ``schema`` (an openAPIV3Schema node), depth first in schema order.

    An object with ``x-kubernetes-preserve-unknown-fields`` and no declared properties (a Pod
    template, a volume source) is one row: its content belongs to Kubernetes, not to this API.
    Array items are walked under ``path[]``.
    """
    rows = []
    if prefix:
        rows.append(
            FieldRow(
                path=prefix,
                type=_type(schema),
                required=required,
                default=_code(schema["default"]) if "default" in schema else "",
                allowed=_allowed(schema),
                description=" ".join(schema.get("description", "").split()),
            )
        )
    node = schema
    item_prefix = prefix
    while node.get("type") == "array" and "items" in node:
        node, item_prefix = node["items"], f"{item_prefix}[]"
    must = set(node.get("required", ()))
    for name, child in node.get("properties", {}).items():
        path = f"{item_prefix}.{name}" if item_prefix else name
        rows.extend(field_rows(child, path, name in must))
    return rows


def load_crd(path: Path = CRD) -> dict:
    return yaml.safe_load(path.read_text())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def render_crd(crd: dict) -> list[str]:
    names, spec = crd["spec"]["names"], crd["spec"]
    out = ["## TrainingJob", ""]
    out.append(
        f"`{names['kind']}` — `{names['plural']}.{spec['group']}`, scope "
        f"{spec['scope']}, short names {', '.join(_code(n) for n in names.get('shortNames', []))}, "
        f"categories {', '.join(_code(c) for c in names.get('categories', []))}. "
        f"Source: `{CRD.relative_to(ROOT)}` (the chart's `crds/` holds the same file)."
    )
    for version in spec["versions"]:
        schema = version["schema"]["openAPIV3Schema"]
        flags = [f for f in ("served", "storage") if version.get(f)]
        out += ["", f"### `{spec['group']}/{version['name']}` ({', '.join(flags)})", ""]
        if schema.get("description"):
            out += [" ".join(schema["description"].split()), ""]
        rows = [
            (
                f"`{r.path}`",
                r.type,
                "yes" if r.required else "",
                r.default,
                r.allowed,
                r.description,
            )
            for r in field_rows(schema)
        ]
        out += _table(("field", "type", "required", "default", "allowed", "description"), rows)
        columns = version.get("additionalPrinterColumns", [])
        if columns:
            out += [
                "",
                f"`kubectl get {(names.get('shortNames') or [names['plural']])[0]}` columns:",
                "",
            ]
            out += _table(
                ("column", "type", "from", "description"),
                [
                    (c["name"], c["type"], f"`{c['jsonPath']}`", c.get("description", ""))
                    for c in columns
                ],
            )
    return out


def undocumented_fields(crd: dict) -> list[str]:
    """Field paths of the spec (not the status the operator writes) that lack a description."""
    return [
        r.path
        for v in crd["spec"]["versions"]
        for r in field_rows(v["schema"]["openAPIV3Schema"])
        if not r.description and r.path.startswith("spec")
    ]


# --- the worker's flags ---------------------------------------------------------------------


def _allowed_option(o) -> str:
    """An option's choices and bounds in the words of the CRD rows (``_allowed``)."""
    node = {"enum": list(o.choices)} if o.choices else {}
    if o.minimum is not None:
        node.update(minimum=o.minimum, exclusiveMinimum=o.exclusive_minimum)
    if o.maximum is not None:
        node["maximum"] = o.maximum
    return _allowed(node)


def render_flags() -> list[str]:
    from ringtrain import options

    out = [
        "## Flags of `ringtrain worker`",
        "",
        (
            "From the option table `trainer/ringtrain/options.py`, which also generates the "
            "worker's parser, the pod arguments the operator writes and the CRD's `spec.trainer` "
            "(`hack/gen-crd`). The worker checks the lower bounds; the upper bounds are the CRD's. "
            "Pods created by the operator always get `--metrics-port 9400 --json "
            "--termination-log /dev/termination-log`."
        ),
    ]
    for group in options.GROUPS:
        rows = [
            (
                f"`{o.cli_flag}`" if o.cli_flag else "",
                _code(o.default) if o.default is not None and o.type is not bool else "",
                _allowed_option(o),
                f"`spec.trainer.{o.crd}`" if o.crd else "",
                o.help,
            )
            for o in group.options
        ]
        out += ["", f"### {group.title}", ""]
        out += _table(("flag", "default", "allowed", "TrainingJob field", "meaning"), rows)
    return out


# --- the metrics catalogue -------------------------------------------------------------------


@dataclass(frozen=True)
class MetricRow:
    family: str  # the name as registered and in `# TYPE` (counters without `_total`)
    type: str
    help: str
    labels: tuple[str, ...]
    label_values: dict  # label -> the closed set of values created at start-up, if any

    @property
    def queried_as(self) -> str:
        """The name a PromQL query uses: counters carry `_total` in the exposition."""
        return self.family + "_total" if self.type == "counter" else self.family

    @property
    def sample_names(self) -> set[str]:
        return {self.family, *(self.family + s for s in SAMPLE_SUFFIXES.get(self.type, ()))}


def _label_names(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    """Family name -> declared label names.

    collect() only yields samples for label children that exist, so a labelled metric nobody has
    touched yet (the operator's per-namespace counters) shows no labels there. prometheus_client
    has no public accessor for the declared names; this reads its collectors' ``_labelnames``,
    and tests/docs pins the result so a client change fails loudly instead of dropping labels.
    """
    names = {}
    for collector in list(registry._collector_to_names):
        for family in collector.describe():
            names[family.name] = tuple(getattr(collector, "_labelnames", ()))
    return names


def metric_rows(make) -> list[MetricRow]:
    """Instantiate a component's metrics class on a fresh registry and read back what it exposes."""
    registry = CollectorRegistry()
    make(registry=registry)
    declared = _label_names(registry)
    rows = []
    for family in registry.collect():
        values: dict[str, list[str]] = {}
        for sample in family.samples:
            for key, value in sample.labels.items():
                if key not in ("le", "quantile") and value not in values.setdefault(key, []):
                    values[key].append(value)
        labels = declared.get(family.name) or tuple(values)
        # A label whose children are all created at start-up (the operator's `state`) is a
        # closed set worth listing; a single child (`version` of an info gauge) is not, and
        # listing it would make the reference stale on every release.
        rows.append(
            MetricRow(
                family.name,
                family.type,
                family.documentation,
                labels,
                {k: v for k, v in values.items() if k in labels and len(v) > 1},
            )
        )
    return sorted(rows, key=lambda r: r.family)


def components() -> list[tuple[str, str, object]]:
    """(title, source, metrics class) of every component that exposes metrics."""
    from ringtrain_operator.metrics import OperatorMetrics
    from ringtrain_trainer.telemetry.metrics import TrainerMetrics

    return [
        (
            "Trainer (`ringtrain worker`, port 9400)",
            "trainer/ringtrain_trainer/telemetry/metrics.py",
            TrainerMetrics,
        ),
        (
            "Trainer's IPU numerics (`ringtrain worker`, port 9400)",
            "trainer/ringtrain_trainer/optim/numerics.py",
            _numerics_metrics,
        ),
        ("Operator (port 8080)", "operator/ringtrain_operator/metrics.py", OperatorMetrics),
    ]


def _numerics_metrics(registry):
    """The worker registers these beside TrainerMetrics once its numerics are resolved."""
    from ringtrain_trainer.optim.loss_scale import LossScale
    from ringtrain_trainer.optim.numerics import Numerics, NumericsMetrics

    return NumericsMetrics(registry, 1, 1, Numerics("fp32", "OFF", LossScale()))


def catalogue() -> list[MetricRow]:
    """Every metric of every component: what dashboards, rules and docs may name."""
    return [row for _, _, make in components() for row in metric_rows(make)]


def render_metrics() -> list[str]:
    out = [
        "## Metrics",
        "",
        (
            "Read from the components' own registries. Counters are queried with `_total`, "
            "histograms through `_bucket`, `_sum` and `_count`; Prometheus adds the scrape "
            "target's labels (the PodMonitor's job and replica labels) to every series."
        ),
    ]
    for title, source, make in components():
        out += ["", f"### {title}", "", f"Source: `{source}`.", ""]
        rows = []
        for m in metric_rows(make):
            labels = ", ".join(
                f"`{name}`"
                + (
                    f" ({', '.join(_code(v) for v in m.label_values[name])})"
                    if m.label_values.get(name)
                    else ""
                )
                for name in m.labels
            )
            rows.append((f"`{m.queried_as}`", m.type, labels, m.help))
        out += _table(("metric", "type", "labels", "help"), rows)
    return out


# --- exit codes and commands -----------------------------------------------------------------


def exit_constants(path: Path = ERRORS) -> list[tuple[str, int, str]]:
    """(name, value, `#:` comment) of every ``EXIT_*`` constant, in source order."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id.startswith("EXIT_")
        ):
            doc, i = [], node.lineno - 2
            while i >= 0 and lines[i].lstrip().startswith("#:"):
                doc.insert(0, lines[i].lstrip()[2:].strip())
                i -= 1
            found.append((node.targets[0].id, ast.literal_eval(node.value), " ".join(doc)))
    return found


def _subclasses(cls) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def render_exit_codes() -> list[str]:
    from ringtrain import errors

    out = [
        "## Exit codes of `ringtrain worker`",
        "",
        (
            "From `trainer/ringtrain/errors.py`. The `ExitCode` restart policy fails the job on "
            "1–127 and restarts the whole gang on 128 and above."
        ),
        "",
    ]
    out += _table(
        ("code", "constant", "meaning"),
        [(str(value), f"`{name}`", doc) for name, value, doc in exit_constants()],
    )
    out += ["", "Which error ends in which code (`exit_code_for`):", ""]
    # __new__: classify the type without calling an __init__ that may want rank, step, peer.
    rows = [
        (
            f"`{cls.__name__}`",
            str(errors.exit_code_for(cls.__new__(cls))),
            (cls.__doc__ or "").strip().splitlines()[0],
        )
        for cls in [errors.RingtrainError, *_subclasses(errors.RingtrainError)]
        # the contract package's own, not whatever else a caller happened to import
        if cls.__module__.partition(".")[0] == "ringtrain"
    ]
    rows += [
        (
            "`KeyboardInterrupt`",
            str(errors.exit_code_for(KeyboardInterrupt())),
            "Ctrl-C or SIGTERM: stopped from outside",
        ),
        ("any other exception", str(errors.exit_code_for(Exception())), "a bug: please report it"),
    ]
    out += _table(("error", "code", "meaning"), rows)
    return out


def render_commands() -> list[str]:
    from ringtrain.cli import COMMANDS

    out = [
        "## Commands",
        "",
        (
            "From `trainer/ringtrain/cli.py`; `ringtrain <command> --help` lists a "
            "command's options."
        ),
        "",
    ]
    out += _table(
        ("command", "module", "what it does"),
        [
            (f"`ringtrain {' '.join(words)}`", f"`{module}`", text)
            for words, (module, text) in COMMANDS.items()
        ],
    )
    return out


# --- the file --------------------------------------------------------------------------------


def render(crd: dict | None = None) -> str:
    """The whole of docs/reference.md."""
    lines = [
        "# ringtrain reference",
        "",
        (
            "<!-- Generated by hack/gen-docs from the CRD, trainer/ringtrain/options.py, "
            "the metric "
            "registries, trainer/ringtrain/errors.py "
            "and trainer/ringtrain/cli.py. Do not edit: run `.venv/bin/python hack/gen-docs`. -->"
        ),
        "",
    ]
    for section in (
        render_crd(crd if crd is not None else load_crd()),
        render_flags(),
        render_metrics(),
        render_exit_codes(),
        render_commands(),
    ):
        lines += [*section, ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff when stale")
    parser.add_argument(
        "--undocumented",
        action="store_true",
        help="list spec fields of the CRD without a description",
    )
    parser.add_argument("--output", type=Path, default=OUT, help=f"default {OUT.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if args.undocumented:
        print("\n".join(undocumented_fields(load_crd())))
        return 0
    pages = {args.output: render()}
    if args.output == OUT:  # the whole run also renders the tutorial notebook as its page
        pages[notebook_page.PAGE] = notebook_page.render()
    if not args.check:
        for path, want in pages.items():
            path.write_text(want)
        return 0
    stale = 0
    for path, want in pages.items():
        have = path.read_text() if path.exists() else ""
        if have == want:
            continue
        stale = 1
        sys.stdout.writelines(
            difflib.unified_diff(
                have.splitlines(keepends=True),
                want.splitlines(keepends=True),
                fromfile=f"{path} (committed)",
                tofile=f"{path} (generated)",
            )
        )
        print(f"{path} is stale: run .venv/bin/python hack/gen-docs", file=sys.stderr)
    return stale


if __name__ == "__main__":
    sys.exit(main())
