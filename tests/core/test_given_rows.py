"""Prompt positions given as input rows (core/request.py PromptEmbeds): which of a chunk's
positions take which rows, where a chunk may end when an image's positions attend to each
other both ways, and how the prefix cache names blocks around them."""

from __future__ import annotations

from iterserve.core.kv_cache import KVCacheManager
from iterserve.core.request import PromptEmbeds, Request
from iterserve.core.scheduler import _whole_spans
from iterserve.sampling_params import SamplingParams

SPANS = ((3, 4), (10, 2))  # positions 3-6 and 10-11, rows 0-3 and 4-5


def test_a_chunk_takes_the_rows_of_its_positions() -> None:
    embeds = PromptEmbeds(list(range(6)), b"k", SPANS)
    assert embeds.pieces(0, 3) == []
    assert embeds.pieces(0, 5) == [(3, 0, 2)]  # positions 3-4: rows 0-1
    assert embeds.pieces(5, 7) == [(0, 2, 2), (5, 4, 2)]
    whole = PromptEmbeds(list(range(8)), b"k")
    assert whole.whole_prompt and whole.pieces(2, 3) == [(0, 2, 3)]


def test_a_chunk_never_ends_inside_a_span_that_attends_both_ways() -> None:
    assert _whole_spans(SPANS, 0, 5) == 3, "stops before the span it would cut"
    assert _whole_spans(SPANS, 3, 2) == 4, "starting at a span: the whole span, past budget"
    assert _whole_spans(SPANS, 5, 1) == 2, "starting inside one (a cache hit): to its end"
    assert _whole_spans(SPANS, 0, 8) == 8 and _whole_spans(SPANS, 7, 3) == 3, "ends outside"


def test_blocks_before_the_first_given_position_are_named_by_their_tokens() -> None:
    def names(rows_key: bytes) -> list:
        kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
        request = Request("r", list(range(100, 116)), SamplingParams(), 0.0)
        request.prompt_embeds = PromptEmbeds(None, rows_key, ((9, 3),))
        return kv._hashes_for(request)

    same, other = names(b"image a"), names(b"image b")
    assert len(same) == 4
    assert same[:2] == other[:2], "positions 0-7: tokens only"
    assert same[2] != other[2] and same[3] != other[3], "from the block holding position 9"
