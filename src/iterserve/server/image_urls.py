"""Image URLs a chat names, read into data URLs before the chat is rendered, where the
server is told it may: `file://` under `--allowed-local-media-path`, `http(s)://` from the
hosts of `--allowed-media-domains` (vLLM's flags). By default the server reads neither
(data URLs only): vLLM fetches any address unless told otherwise; here a server reaches
nothing on the network for a request unless its operator named where.

A fetch has a time limit and a size limit, follows no redirect (it could lead off the
named hosts), and whatever fails is a 400 naming the part."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx

from iterserve.chat.messages import ChatMessage
from iterserve.sampling_params import InvalidRequestError

ANY_DOMAIN = "*"


@dataclass(frozen=True)
class MediaAccess:
    local_path: Path | None = None  # --allowed-local-media-path
    domains: tuple[str, ...] = ()  # --allowed-media-domains ("*": any host)
    timeout_s: float = 10.0
    max_bytes: int = 32 * 2**20

    async def resolve(self, messages: Sequence[ChatMessage]) -> None:
        """Each image_url part that names a file or a web address, made a data URL of its
        bytes (in place); InvalidRequestError naming the part where it may not be read."""
        for i, message in enumerate(messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                image = part.image_url
                if image is None or image.url.startswith("data:"):
                    continue
                field = f"messages.{i}.content.{j}.image_url"
                scheme = urlsplit(image.url).scheme.lower()
                if scheme == "file":
                    data = self._read_file(image.url, field)
                elif scheme in ("http", "https"):
                    data = await self._fetch(image.url, field)
                else:
                    continue  # what it is not, image_parts.py says
                image.url = "data:image;base64," + base64.b64encode(data).decode()

    def _read_file(self, url: str, field: str) -> bytes:
        if self.local_path is None:
            raise InvalidRequestError(
                f"{field}: file URLs are read only under --allowed-local-media-path", field
            )
        root = self.local_path.resolve()
        path = Path(unquote(urlsplit(url).path)).resolve()
        if not path.is_relative_to(root):
            raise InvalidRequestError(f"{field}: {path} is not under {root}", field)
        try:
            if path.stat().st_size > self.max_bytes:
                raise InvalidRequestError(f"{field}: over {self.max_bytes} bytes", field)
            return path.read_bytes()
        except OSError as error:
            raise InvalidRequestError(
                f"{field}: cannot read {path}: {error.strerror}", field
            ) from None

    async def _fetch(self, url: str, field: str) -> bytes:
        host = (urlsplit(url).hostname or "").lower()
        if ANY_DOMAIN not in self.domains and host not in self.domains:
            named = ", ".join(self.domains) or "none"
            raise InvalidRequestError(
                f"{field}: the server fetches images only from --allowed-media-domains "
                f"({named}), not {host or url!r}; or give the image inline as a data URL",
                field,
            )
        try:
            async with (
                httpx.AsyncClient(timeout=self.timeout_s) as client,
                client.stream("GET", url) as reply,
            ):
                if reply.status_code != 200:  # a redirect too: it could leave the named hosts
                    raise InvalidRequestError(
                        f"{field}: fetching {url} answered {reply.status_code}", field
                    )
                data = bytearray()
                async for chunk in reply.aiter_bytes():
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise InvalidRequestError(f"{field}: over {self.max_bytes} bytes", field)
                return bytes(data)
        except httpx.HTTPError as error:
            raise InvalidRequestError(f"{field}: cannot fetch {url}: {error!r}", field) from None
