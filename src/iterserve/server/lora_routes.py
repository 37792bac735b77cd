"""vLLM's routes for LoRA adapters at run time: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (behind the API key like the rest of /v1). The adapter is read and
checked on the engine's thread between two steps; a bad one is a 400 naming the field."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from iterserve.core.lora import LoRARequest
from iterserve.server.errors import APIError
from iterserve.server.serving import ServingContext


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


def lora_routes(ctx: ServingContext, enabled: bool) -> APIRouter:
    v1 = APIRouter(prefix="/v1")

    def engine_call() -> Callable[[Callable[[Any], Any]], Awaitable[Any]]:
        """The engine's `call` (a function run on its thread between steps), or a refusal."""
        if not enabled:
            raise APIError(
                400,
                "this server serves no LoRA adapters: start it with --enable-lora",
                "lora_name",
            )
        call = getattr(ctx.engine, "call", None)
        if call is None:
            raise APIError(
                400,
                "loading LoRA adapters at run time is not supported over data-parallel "
                "replicas; give them with --lora-modules",
                "lora_name",
            )
        return call

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        call = engine_call()
        name = body.lora_name
        if not name or name in ctx.served_model_names or name in ctx.loras:
            raise APIError(400, f"a model or adapter named {name!r} is served already", "lora_name")

        def load(engine: Any) -> LoRARequest:  # an LLMEngine, on its own thread
            lora = LoRARequest(name, engine.loras.next_id(), body.lora_path)
            engine.loras.add(lora)
            return lora

        ctx.loras[name] = await call(load)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        call = engine_call()
        name = body.lora_name
        if name not in ctx.loras:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded", "lora_name")
        del ctx.loras[name]  # new requests no longer find it; running ones finish
        await call(lambda engine: engine.loras.remove(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return v1
