"""JSON merge patches (RFC 7386) computed from the object as stored and the object as desired."""

from __future__ import annotations

from typing import Any


def merge_patch_to(current: Any, desired: Any) -> Any:
    """The merge patch that turns ``current`` into ``desired``: keys ``desired`` lacks become
    ``None`` (deleted), nested mappings recurse, anything else is replaced whole. Applying the
    result to ``current`` gives ``desired`` exactly, so a field removed from a spec leaves the
    child too. Returns ``{}`` when they are equal."""
    if not isinstance(current, dict) or not isinstance(desired, dict):
        return desired
    patch: dict[str, Any] = {key: None for key in current if key not in desired}
    for key, value in desired.items():
        if key not in current:
            patch[key] = value
        elif current[key] != value:
            patch[key] = merge_patch_to(current[key], value)
    return patch



def overlay_patch_to(current: Any, desired: Any) -> Any:
    """The merge patch that sets every field ``desired`` names and leaves the rest of ``current``
    alone (for objects the API server fills with defaults, e.g. a Deployment's strategy): nested
    mappings recurse, lists and scalars are replaced whole. ``{}`` when nothing needs setting."""
    if not isinstance(current, dict) or not isinstance(desired, dict):
        return desired
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        if key not in current:
            patch[key] = value
        elif current[key] != value:
            inner = overlay_patch_to(current[key], value)
            if inner != {}:
                patch[key] = inner
    return patch
