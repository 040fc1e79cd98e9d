"""YAML from a user's file, with bounds: what ``ringtrain render`` and ``ringtrain run`` read.

``yaml.safe_load`` builds no objects of the user's choosing, but nothing else bounds it: an alias
bomb (nine anchors, each a list of nine aliases of the one before) loads as a few hundred shared
nodes and expands to 9⁹ as soon as anything walks, copies or dumps it; a document nested
10,000 deep ends in a ``RecursionError`` traceback (PyYAML's composer recurses); and a huge file
is held whole, then as nodes several times its size (issue 20). So the text is capped at
:data:`MAX_BYTES` (the API server's own request limit: no larger TrainingJob can exist on a
cluster), and before anything is built one pass over the parser's events refuses nesting deeper
than :data:`MAX_DEPTH` and more than :data:`MAX_NODES` nodes with every alias counted at its
expanded size, naming the line. Everything refused is ``InvalidSpec`` (exit 2) naming the file.
"""

from __future__ import annotations

from typing import IO, Any

import yaml

from ringtrain.errors import InvalidSpec

from .limits import MAX_DEPTH as SPEC_DEPTH

#: The Kubernetes API server refuses a request body over 3 MiB.
MAX_BYTES = 3 << 20
#: YAML nesting (the spec's own limit, plus the document levels above ``spec``).
MAX_DEPTH = SPEC_DEPTH + 8
#: Nodes of all documents of a file, aliases at their expanded size: examples/keras-model.yaml,
#: an inline model, has under 200; each costs about 570 bytes once composed (measured).
MAX_NODES = 100_000
#: Bytes of scalar values, aliases at their expanded size: a file's own text at most, twice.
MAX_EXPANDED_BYTES = 2 * MAX_BYTES
#: once checked, the document is built by libyaml where present (the same safe constructors)
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


_OPEN = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_CLOSE = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


def _line(ev: yaml.Event) -> str:
    mark = ev.start_mark
    return f"line {mark.line + 1}" if mark is not None else "unknown line"


def check(text: str) -> str | None:
    """Why ``text`` is refused (too deep, too many nodes, too many bytes once expanded), or
    None: one pass over the parser's events, which are dropped as they come, so the pass holds
    only the open collections and the expanded size of each anchor, never the nodes. Bytes
    count too: a long scalar aliased a thousand times is a few nodes but gigabytes once
    ``render`` writes it out."""
    open_: list[list] = []  # [expanded nodes, expanded bytes, anchor] of each open collection
    sizes: dict[str, tuple[int, int]] = {}  # anchor -> expanded (nodes, bytes)
    total = total_bytes = 0
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(ev, _OPEN):
            if len(open_) >= MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels ({_line(ev)})"
            open_.append([1, 0, ev.anchor])
            total += 1
            continue
        if isinstance(ev, _CLOSE):
            n, size, anchor = open_.pop()
        elif isinstance(ev, yaml.ScalarEvent):
            n, size, anchor = 1, len(ev.value), ev.anchor
            total += 1
            total_bytes += size
        elif isinstance(ev, yaml.AliasEvent):
            (n, size), anchor = sizes.get(ev.anchor or "", (1, 0)), None
            total += n
            total_bytes += size
        else:
            continue
        if anchor is not None:
            sizes[anchor] = (n, size)
        if open_:
            open_[-1][0] += n
            open_[-1][1] += size
        if total > MAX_NODES:
            return (
                f"more than {MAX_NODES} nodes, aliases counted at their expanded size ({_line(ev)})"
            )
        if total_bytes > MAX_EXPANDED_BYTES:
            return (
                f"more than {MAX_EXPANDED_BYTES >> 20} MiB of values, aliases counted at their "
                f"expanded size ({_line(ev)})"
            )
    return None


def load_all(stream: IO[str], source: str) -> list[Any]:
    """Every document of ``stream`` (named ``source`` in messages), within the bounds above;
    ``InvalidSpec`` for anything else: too large, too deep, too many nodes or bytes, not UTF-8,
    not YAML, a tagged value that does not construct (``!!int abc``, an invalid date)."""
    try:
        text = stream.read(MAX_BYTES + 1)
    except UnicodeDecodeError as e:
        raise InvalidSpec(
            f"{source}: not UTF-8 text (byte {e.object[e.start : e.start + 1]!r} at offset "
            f"{e.start}); YAML files are UTF-8"
        ) from None
    if len(text) > MAX_BYTES:
        raise InvalidSpec(
            f"{source}: larger than {MAX_BYTES >> 20} MiB (the API server's limit on a request)"
        )
    try:
        why = check(text)
        if why is not None:
            raise InvalidSpec(f"{source}: refused: {why}")
        return list(yaml.load_all(text, Loader=_LOADER))
    except yaml.YAMLError as e:
        raise InvalidSpec(f"{source}: not valid YAML: {e}") from None
    except (ValueError, TypeError, OverflowError) as e:  # a tagged value (!!int abc, a date)
        raise InvalidSpec(f"{source}: a value YAML cannot read: {e}") from None
