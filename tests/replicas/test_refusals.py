"""A replica's refusal crosses to the front end as data (pickled, as Ray sends it) and is
raised there as the error a single engine gives: the same message, field and code."""

from __future__ import annotations

import pickle

from iterserve.engine.request_stream import EngineOverloadedError
from iterserve.invalid_request import CONTEXT_LENGTH_EXCEEDED
from iterserve.replicas.events import Refusal
from iterserve.sampling_params import InvalidRequestError


def test_a_refusal_comes_back_as_the_same_error() -> None:
    too_long = InvalidRequestError("too long", "prompt", CONTEXT_LENGTH_EXCEEDED)
    error = pickle.loads(pickle.dumps(Refusal.of(too_long))).error()
    assert isinstance(error, InvalidRequestError)
    assert (str(error), error.param, error.code) == ("too long", "prompt", CONTEXT_LENGTH_EXCEEDED)
    busy = pickle.loads(pickle.dumps(Refusal.of(EngineOverloadedError("full", 2.5)))).error()
    assert isinstance(busy, EngineOverloadedError) and busy.retry_after == 2.5
