"""The error for a request the engine refuses (a 400 on the server)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses, with a message meant for the person who sent it.

    `param` names the offending field (OpenAI error shape) when there is one; `code` is
    OpenAI's error code where it has one (`context_length_exceeded`).
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


# The request does not fit the model's context (OpenAI's code, which clients look for).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
