"""Walks through the code, counted from a runtime trace (issue 33, item 5; hack/walk-count).

A profile hook records, per thread, every call and return of a project frame (files under
trainer/ and operator/) with its call site, and every C call into `engine._native` as the one
file `engine/_native.c`. Standard library, numpy, grpc and prometheus frames are not recorded:
their time is the project caller's. The events rebuild each thread's call tree; the walk is that
tree flattened in execution order (the caller resumes after each callee). A *stay* is a maximal
run of one file in the walk; a *return* is a stay in a file already visited.

Levels (each mechanical):
  raw      every call counts, loop iterations included;
  reading  the calling-context tree: calls from one context with the same call site and callee
           are one node (a loop is read once, with every branch any iteration took);
  review   reading, plus a call that makes no further project call (an accessor, a small pure
           helper) folded into its caller's stay; C kernels and kube API calls are kept.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NATIVE = "engine/_native.c"
KEPT = (NATIVE, "kube.py")  # never folded at review level: each is a kernel or an API call
LEVELS = {"raw": (False, False), "reading": (True, False), "review": (True, True)}


def short(path: str) -> str | None:
    """trainer/ringtrain_trainer/ring/tcp.py -> ring/tcp.py; None outside the project."""
    for top in ("trainer", "operator"):
        base = f"{ROOT / top}/"
        if path.startswith(base):
            rel = path[len(base) :]
            for package in ("ringtrain_trainer/", "ringtrain_operator/"):
                rel = rel.removeprefix(package)
            return rel
    return None


class Recorder:
    """The profile hook. `window` gates recording; `as_file` renames stand-ins (code object or
    file -> the project file they stand for, e.g. the tests' FakeKube -> kube.py)."""

    def __init__(self, as_file: dict | None = None) -> None:
        self.as_file = as_file or {}
        self.window: int | None = None
        self.events: list[tuple] = []

    def own(self, code) -> str | None:
        return (
            self.as_file.get(code) or self.as_file.get(code.co_filename) or short(code.co_filename)
        )

    def site(self, frame) -> tuple[str | None, int]:
        while frame is not None:
            name = self.own(frame.f_code)
            if name:
                return name, frame.f_lineno
            frame = frame.f_back
        return None, 0

    def hook(self, frame, event, arg) -> None:
        if self.window is None:
            return
        thread = threading.current_thread().name
        if event in ("call", "return"):
            name = self.own(frame.f_code)
            if name:
                where = self.site(frame.f_back) if event == "call" else (None, 0)
                self.events.append((self.window, thread, event, name, frame.f_code.co_name, *where))
        elif event.startswith("c_") and "_native" in (getattr(arg, "__module__", "") or ""):
            where = self.site(frame) if event == "c_call" else (None, 0)
            kind = "call" if event == "c_call" else "return"
            self.events.append((self.window, thread, kind, NATIVE, arg.__name__, *where))

    def dump(self, path: Path) -> None:
        with path.open("w") as out:
            out.writelines(json.dumps(e) + "\n" for e in self.events)
        self.events.clear()


@dataclass
class Node:
    file: str | None
    fn: str | None
    site: tuple | None
    kids: list[Node] = field(default_factory=list)


def trees(events) -> dict[tuple, Node]:
    """(window, thread) -> the call tree of that thread in that window."""
    roots: dict[tuple, Node] = {}
    stacks: dict[tuple, list[Node]] = {}
    for window, thread, event, file, fn, site_file, site_line in events:
        key = (window, thread)
        stack = stacks.setdefault(key, [roots.setdefault(key, Node(None, None, None))])
        if event == "call":
            node = Node(file, fn, (site_file, site_line))
            stack[-1].kids.append(node)
            stack.append(node)
            continue
        for i in range(len(stack) - 1, 0, -1):  # a frame entered before the window: ignored
            if stack[i].file == file and stack[i].fn == fn:
                del stack[i:]
                break
    return roots


def merge(node: Node) -> None:
    """The calling-context tree: same call site and callee under one node -> one node."""
    merged: dict[tuple, Node] = {}
    for kid in node.kids:
        key = (kid.site, kid.file, kid.fn)
        if key in merged:
            merged[key].kids.extend(kid.kids)
        else:
            merged[key] = kid
    node.kids = list(merged.values())
    for kid in node.kids:
        merge(kid)


def flatten(node: Node, leaves: bool, out: list) -> None:
    for kid in node.kids:
        if leaves and not kid.kids and not kid.file.endswith(KEPT):
            continue  # folded: the caller's stay goes on
        # a top-level call: the window opened inside a running frame (the step loop, the comm
        # thread's loop); the call site's file is that frame's
        caller = node.file or kid.site[0]
        if node.file is None and caller:
            out.append((caller, None))
        out.append((kid.file, kid.fn))
        flatten(kid, leaves, out)
        if caller:
            out.append((caller, None))


def stays(root: Node, level: str) -> list[list]:
    """[[file, [function, ...]], ...] in execution order."""
    once, leaves = LEVELS[level]
    if once:
        merge(root)
    seq: list = []
    flatten(root, leaves, seq)
    out: list[list] = []
    for file, fn in seq:
        if not out or out[-1][0] != file:
            out.append([file, []])
        if fn and fn not in out[-1][1]:
            out[-1][1].append(fn)
    return out


def splice(main: list[list], comm: list[list]) -> list[list]:
    """One reader's walk: the comm thread's walk read where the main thread waits for it (the
    reducer's finish)."""
    at = next(
        i for i, (f, fns) in enumerate(main) if f == "reducer/pipeline.py" and "finish" in fns
    )
    out: list[list] = []
    for file, fns in main[: at + 1] + comm + main[at + 1 :]:
        if out and out[-1][0] == file:
            out[-1][1] += fns
        else:
            out.append([file, list(fns)])
    return out


def counts(walk: list[list]) -> dict:
    seen: set[str] = set()
    back: Counter[str] = Counter()
    for file, _ in walk:
        back[file] += file in seen
        seen.add(file)
    returns = sum(back.values())
    hot = [(f, n) for f, n in back.most_common() if n]
    return {"files": len(seen), "stays": len(walk), "returns": returns, "hot": hot}


def render(title: str, walk: list[list]) -> str:
    lines, seen = [f"== {title}"], set()
    for i, (file, fns) in enumerate(walk, 1):
        what = ", ".join(fns[:4]) + (" ..." if len(fns) > 4 else "")
        lines.append(f"{i:3d} {'R' if file in seen else ' '} {file:28s} {what}".rstrip())
        seen.add(file)
    c = counts(walk)
    lines.append(f"-- {title}: files {c['files']}  stays {c['stays']}  returns {c['returns']}")
    lines.append(("   returns by file: " + ", ".join(f"{f} {n}" for f, n in c["hot"])).rstrip())
    return "\n".join(lines)


def load(path: Path) -> list[tuple]:
    return [tuple(json.loads(line)) for line in path.read_text().splitlines()]
