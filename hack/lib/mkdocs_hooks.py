"""mkdocs hooks of the documentation site (mkdocs.yml ``hooks:``).

The project's docstrings name code with Sphinx roles (``:class:`Job```, ``:meth:`.wait```), which
the API reference (docs/client-api.md, mkdocstrings, decision 0212) would otherwise show as a
literal ``:class:`` before the name: the role is dropped, the name stays code. No cross-reference
is attempted — the names are in the same page or the next module.
"""

from __future__ import annotations

import re
from typing import Any

#: a Sphinx role whose name markdown already turned into ``<code>…</code>``
ROLE = re.compile(r":(?:class|mod|meth|func|attr|data|exc|obj):(?=<code>)")


def on_page_content(html: str, **_: Any) -> str:
    return ROLE.sub("", html)
