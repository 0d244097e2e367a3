"""The Python blocks of the docs that tests run as printed."""

from __future__ import annotations

import re
from pathlib import Path


def python_block(path: Path, marker: str) -> str:
    """The ```python block right after the ``<!-- marker ... -->`` comment in ``path``."""
    match = re.search(rf"<!-- {marker}[^>]*-->\n```python\n(.*?)```", path.read_text(), re.DOTALL)
    assert match, f"{path.name} has no ```python block after its <!-- {marker} --> marker"
    return match.group(1)
