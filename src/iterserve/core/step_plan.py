"""The step being composed by the scheduler: tokens per request and the budget left."""

from __future__ import annotations

from iterserve.core.request import Request


class StepPlan:
    """The step being composed: tokens per request and the budget left."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.tokens: dict[Request, int] = {}
        self.drafts: dict[Request, list[int]] = {}  # speculating decodes' guesses
        self.preempted: list[Request] = []
        self.num_long_prefills = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens.values())

    def add(self, request: Request, n: int) -> None:
        self.tokens[request] = n
        self.budget -= n

    def remove(self, request: Request) -> None:
        self.budget += self.tokens.pop(request, 0)
        self.drafts.pop(request, None)

    def real(self, request: Request, n: int) -> int:
        """Of a request's n tokens in this step, those that are not drafts."""
        return n - len(self.drafts.get(request, ()))
