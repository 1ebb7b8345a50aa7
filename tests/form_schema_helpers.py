"""Reading the JSON schema of a flow's run form as Prefect's UI shows it (the full form's and
the short form's tests)."""

from __future__ import annotations


def nullable_fields(node, where="") -> list[str]:
    """Where a JSON schema lets a value be null (Prefect's form shows those as toggles)."""
    found = []
    if isinstance(node, dict):
        options = node.get("anyOf", []) + node.get("oneOf", [])
        if node.get("type") == "null" or any(o.get("type") == "null" for o in options):
            found.append(where)
        for key, value in node.items():
            found += nullable_fields(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += nullable_fields(value, f"{where}[{i}]")
    return found
