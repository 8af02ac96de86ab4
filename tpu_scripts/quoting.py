"""`clip`: a user's value quoted for a one-line message, cut without breaking the quotes."""
from __future__ import annotations


def clip(value, limit: int) -> str:
    """`repr` of `value` (as text) cut to its first `limit` characters, "..." after the closing
    quote when cut: `{x!r:.30}` would cut the repr itself and drop the closing quote."""
    text = value if isinstance(value, str) else str(value)
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
