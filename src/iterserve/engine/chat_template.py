"""--chat-template: the Jinja template a model's chats are rendered with in place of the one
its checkpoint carries (vLLM's --chat-template, llama.cpp's --chat-template-file). A base
model's GGUF often has none, and a quantizer's copy of an instruct model may carry an old or
broken one; without this a user could only send plain prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from iterserve.config import ConfigError
from iterserve.engine.prompts import render_chat
from iterserve.sampling_params import InvalidRequestError

# A conversation every chat template takes; rendered once at start-up to find syntax errors.
_PROBE = [{"role": "user", "content": "Hello"}]


def resolve_chat_template(
    flag: str | None, loaded_template: str | None, tokenizer: Any, name: str = "--chat-template"
) -> str | None:
    """--chat-template (a template, or a file holding one) over the checkpoint's own template;
    ConfigError naming `name` if it is neither a file nor a template, or does not parse: said
    at start-up, not as a 400 on every chat request."""
    if flag is None:
        return loaded_template
    template = _read_if_file(flag, name)
    if not _looks_like_a_template(template):
        raise ConfigError(
            f"{name} {flag!r}: no such file, and not a Jinja template ({{{{ or {{% missing)"
        )
    if problem := template_problem(template, tokenizer):
        raise ConfigError(f"{name} {problem}")
    return template


def template_problem(template: str, tokenizer: Any) -> str | None:
    """Why `template` cannot render chats ("is not a Jinja template", "does not parse, line
    3: ..."), found by rendering a one-message conversation; None if it renders one, or
    refuses it by a rule of its own about conversations (one that insists on a system
    message, say): the requests it refuses get their 400 then."""
    if not _looks_like_a_template(template):
        return "is not a Jinja template ({{ or {% missing)"
    try:
        render_chat(tokenizer, template, _PROBE)
    except InvalidRequestError as error:
        if isinstance(error.__cause__, jinja2.TemplateSyntaxError):
            syntax = error.__cause__
            return f"does not parse, line {syntax.lineno}: {syntax.message}"
    return None


def _looks_like_a_template(text: str) -> bool:
    return "{{" in text or "{%" in text


def _read_if_file(flag: str, name: str) -> str:
    """The text of the file `flag` names, else `flag` itself (a template inline)."""
    if "{" in flag:  # a template: no file name to try
        return flag
    path = Path(flag).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return flag
    except OSError as error:  # a directory, no permission, a name too long for a path
        raise ConfigError(f"{name} {flag!r}: cannot read it: {error}") from None
