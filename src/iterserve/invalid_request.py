"""The error for a request the engine refuses (a 400 on the server)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses, with a message meant for the person who sent it.

    `param` names the offending field (OpenAI error shape) when there is one.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
