"""Request fields of OpenAI's or vLLM's API that would change the output and that this
server does not honour. Unknown fields are otherwise ignored (as vLLM does), so without
this list a client setting one would get a 200 and an answer that silently disregards
it; here it gets a 400 naming the field. A field sent at its neutral value (what clients
often send by default) changes nothing and passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from iterserve.sampling_params import InvalidRequestError

# name -> the values that leave the output as this server makes it.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False, None),
    "length_penalty": (1.0, None),
    "spaces_between_special_tokens": (True, None),
    "logits_processors": (None, []),
    "echo": (False, None),  # vLLM's on chat (the last message repeated); completions has it
    # Completions takes prompt rows (engine/prompt_embeds.py); a chat's messages are text.
    "prompt_embeds": (None, "", []),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "web_search_options": (None,),
}


def refuse_unhonoured(extra: Mapping[str, Any] | None) -> None:
    for name, value in (extra or {}).items():
        neutral = _NEUTRAL.get(name)
        if neutral is not None and value not in neutral:
            raise InvalidRequestError(f"{name} is not supported by this server", name)
