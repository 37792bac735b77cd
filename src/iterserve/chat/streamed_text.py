"""What every streamed reader of an answer holds back: text that may be the start of a
marker, until the next token says whether it is."""

from __future__ import annotations


def partial_marker_length(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`: text
    held back while streaming until the next token says whether the marker comes."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
