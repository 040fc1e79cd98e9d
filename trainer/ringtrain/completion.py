"""`ringtrain completion bash`: shell completion of the command words, `bench`'s kinds, the
worker's flags (from the option table, so a new flag completes without touching this file) and
file names everywhere else (a job's YAML, a run dir, a checkpoint).

zsh reads the same script after ``autoload -U bashcompinit && bashcompinit``.
"""

from __future__ import annotations

import sys

from ringtrain.cli import COMMANDS
from ringtrain.options import WORKER

USAGE = """usage: ringtrain completion bash

Prints a bash completion script for ringtrain:
  source <(ringtrain completion bash)                         # this shell
  ringtrain completion bash > /etc/bash_completion.d/ringtrain  # every shell
zsh: autoload -U bashcompinit && bashcompinit && source <(ringtrain completion bash)"""


def bash(commands: list[tuple[str, ...]]) -> str:
    """The script: ``commands`` are the CLI's command words (``("bench", "step")``...)."""
    first = sorted({w[0] for w in commands})
    groups = {w[0]: sorted(x[1] for x in commands if x[0] == w[0] and len(x) > 1) for w in commands}
    cases = "".join(
        f'    {g}) if [ "$COMP_CWORD" -eq 2 ]; then '
        f'COMPREPLY=($(compgen -W "{" ".join(subs)}" -- "$cur")); return; fi;;\n'
        for g, subs in sorted(groups.items())
        if subs
    )
    flags = " ".join([*sorted(o.cli_flag for o in WORKER if o.cli_flag), "--help"])
    return f"""# ringtrain completion (bash; zsh after bashcompinit)
_ringtrain() {{
  local cur=${{COMP_WORDS[COMP_CWORD]}}
  if [ "$COMP_CWORD" -eq 1 ]; then
    COMPREPLY=($(compgen -W "{" ".join(first)}" -- "$cur")); return
  fi
  case ${{COMP_WORDS[1]}} in
{cases}    worker) if [[ $cur == -* ]]; then
      COMPREPLY=($(compgen -W "{flags}" -- "$cur")); return
    fi;;
    completion) COMPREPLY=($(compgen -W "bash" -- "$cur")); return;;
  esac
  COMPREPLY=($(compgen -f -- "$cur"))
}}
complete -o filenames -F _ringtrain ringtrain
"""


def main(argv: list[str]) -> int:
    if argv != ["bash"]:
        print(USAGE, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    sys.stdout.write(bash(list(COMMANDS)))
    return 0
