"""A group's requests as sent to one replica, and the stream their outputs go to.

The server holds one RequestStream per API request for its whole life; the fleet may
send the stream's requests to one replica, then (if that replica dies before they made
a token) part of them to another. A Dispatch is one such sending: which requests, at
which indices of the stream, with the token counts the router's load figures need and the
token ids it routes by.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from iterserve.engine.request_stream import GenerationRequest, RequestStream


@dataclass(frozen=True)
class Dispatch:
    stream: RequestStream
    # Prompts as token ids, or ImagesPrompts (the replica holds the tower).
    requests: list[GenerationRequest]
    indices: list[int]  # each request's index in `stream`
    counts: list[tuple[int, int]]  # each one's (prompt tokens, most output tokens)
    # Each one's token ids as the router reads them (an ImagesPrompt's: its text, each
    # image its marker).
    routes: list[list[int]]
    # Which replica client each request of the stream runs on now, for the stream's
    # aborts: one dict shared by every part of it sent anywhere.
    homes: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def whole(
        cls, stream: RequestStream, requests: list[GenerationRequest], counts: list[tuple[int, int]],
        routes: list[list[int]], homes: dict[str, Any],
    ) -> Dispatch:  # fmt: skip
        return cls(stream, requests, list(range(len(requests))), counts, routes, homes)

    @property
    def request_ids(self) -> list[str]:
        return [request.request_id for request in self.requests]

    def part(self, positions: list[int]) -> Dispatch:
        """The requests at `positions` (of this dispatch), to be sent again elsewhere. (A
        request sent again keeps its arrival time: its latency counts what the dead
        replica cost it.)"""
        return Dispatch(
            self.stream,
            [self.requests[p] for p in positions],
            [self.indices[p] for p in positions],
            [self.counts[p] for p in positions],
            [self.routes[p] for p in positions],
            self.homes,
        )
