"""Keys of optional parts (docs/development.md "Removing a part")."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def optional_part(path: str, default: Any) -> Any:
    """A key of an optional part (docs/development.md "Removing a part"): in a fork that deleted `path`, a value other than the
    default asks for what is gone and is refused in one line."""
    return field(default=default, metadata={"part": path})
