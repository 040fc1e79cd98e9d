"""`ringtrain completion bash` completes in a real bash: the command words, bench's kinds, the
worker's flags from the option table, and file names elsewhere (issue 34, item 8)."""

from __future__ import annotations

import subprocess
import sys

from ringtrain.options import WORKER


def complete(script: str, words: list[str], cwd) -> list[str]:
    """COMPREPLY of the script's function for a command line of ``words`` (the last is the
    word being completed)."""
    quoted = " ".join(f"'{w}'" for w in words)
    program = (
        f"{script}\nCOMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _ringtrain; "
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    out = subprocess.run(
        ["bash", "--norc", "-c", program], capture_output=True, text=True, cwd=cwd, check=True
    )
    return out.stdout.split()


def test_completion_in_a_real_bash(tmp_path):
    script = subprocess.run(
        [sys.executable, "-m", "ringtrain.cli", "completion", "bash"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert complete(script, ["ringtrain", "re"], tmp_path) == ["render"]
    assert complete(script, ["ringtrain", "bench", "s"], tmp_path) == ["step"]
    assert complete(script, ["ringtrain", "data", "i"], tmp_path) == ["inspect"]
    assert complete(script, ["ringtrain", "da"], tmp_path) == ["data"]
    flags = {o.cli_flag for o in WORKER if o.cli_flag and o.cli_flag.startswith("--ring-st")}
    assert set(complete(script, ["ringtrain", "worker", "--ring-st"], tmp_path)) == flags
    (tmp_path / "job.yaml").write_text("{}")
    assert complete(script, ["ringtrain", "run", "jo"], tmp_path) == ["job.yaml"]
