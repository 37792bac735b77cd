"""`iterserve serve`: load the model, start the engine loop, serve the OpenAI API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from types import FrameType
from typing import TYPE_CHECKING, Any

from iterserve.chat.reasoning_parsers import REASONING_PARSER_CHOICES
from iterserve.chat.tool_parsers import TOOL_PARSER_CHOICES
from iterserve.config import add_engine_args, engine_config_from_args, json_object
from iterserve.replicas.router import ROUTERS
from iterserve.server.response_store import Retention, default_store_path

if TYPE_CHECKING:
    from iterserve.engine.serving_engine import ServingEngine

logger = logging.getLogger("iterserve.server")
_DAY = 86_400.0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI API (/v1/completions, /v1/chat/completions)",
        description="Serve a model over the OpenAI API, with /health and /metrics.",
    )
    _add_front_end_args(p)
    _add_stored_responses_args(p.add_argument_group("stored responses"))
    add_model_args(p, "to serve")
    p.set_defaults(func=serve)


def add_model_args(p: argparse.ArgumentParser, what: str) -> None:
    """The model, its engine and how its answers are read: what `serve` and `run-batch`
    share (`what`: the model's job, for MODEL's help)."""
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help=f"HF directory or GGUF file {what}, or OWNER/NAME[:QUANT] already in the local "
        "Hugging Face cache, as `vllm serve MODEL` takes it, or a model `ollama pull` fetched "
        "(NAME[:TAG]) (the same as --model; default: the bundled SmolLM2-135M)",
    )
    p.add_argument(
        "--served-model-name",
        "-a",
        "--alias",
        nargs="+",
        default=None,
        help="name(s) clients use for the model (default: the model's own name); '*' among "
        "them: any other name a request gives is taken for the first, as llama-server does",
    )
    _add_data_parallel_args(p.add_argument_group("data parallelism"))
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSER_CHOICES,
        default="auto",
        help="how chat answers are read into tool calls: hermes (<tool_call>{...}</tool_call>, "
        "Qwen 2.5/3, Hermes), llama3_json (Llama 3.1/3.2 JSON), mistral ([TOOL_CALLS]), "
        "pythonic ([f(x=1), g()], LFM2), qwen3_coder (<tool_call><function=f>...), deepseek_v3 "
        "(V3, R1), deepseek_v31 (V3.1), granite (<|tool_call|>[...], Granite 3.x), "
        "phi4_mini_json (functools[...], Phi-4-mini), openai (Harmony's to=functions.NAME, "
        "gpt-oss), gemma4 (<|tool_call>call:f{x:1}<tool_call|>, Gemma 4); auto: the format the chat template asks for (Hermes', taught in the "
        "system message, when the template has no place for tools); none: tool_choice "
        "'auto' is refused (docs/tool_calling.md)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSER_CHOICES,
        default="auto",
        help="read a thinking model's <think>...</think> into reasoning_content (Responses: "
        "a reasoning item); qwen3 and deepseek_r1 are vLLM's names for this one format, and "
        "each request's rendered prompt says whether its answer starts inside the thinking; "
        "openai_gptoss reads gpt-oss's Harmony channels (analysis, commentary, final); "
        "gemma4 reads Gemma 4's <|channel>thought...<channel|>; auto: Harmony where the chat "
        "template writes <|channel|>, Gemma 4's channel where it writes that, else where it "
        "writes <think> (named deepseek_r1 when its generation prompt opens it); none: answers "
        "are not read for thinking (docs/reasoning.md)",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        type=json_object,
        default={},
        metavar="JSON",
        help="kwargs every chat's template gets under the request's own chat_template_kwargs, "
        "as vLLM's flag: '{\"enable_thinking\": false}' serves Qwen3 without thinking to "
        "clients that cannot send extra fields; a request's reasoning_effort still sets the "
        "switch",
    )
    p.add_argument(
        "--jinja",
        action="store_true",
        help="llama-server's switch to Jinja chat templates, accepted so its command line "
        "runs as it is: templates here are always Jinja (the model's, or --chat-template)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat with the Jinja template its request sends as chat_template (vLLM's "
        "flag; without it such a request is a 400): for a trusted network only, as the "
        "template runs on the server; the tool-call and reasoning parsers stay the server's",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="a directory whose files a chat may name as images (file:// URLs), as vLLM's flag "
        "(default: none)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="DOMAIN",
        help="hosts a chat's http(s) image URLs are fetched from ('*': any), as vLLM's flag; "
        "by default none: images come inline (data URLs), and the server reaches nothing on "
        "the network for a request",
    )
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    add_engine_args(p)


def _add_front_end_args(p: argparse.ArgumentParser) -> None:
    """Where the server listens, who may call it, and how much it queues."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $ITERSERVE_API_KEY)",
    )
    p.add_argument(
        "--enable-tokenizer-info-endpoint",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve GET /tokenizer_info, vLLM's: the tokenizer's tokenizer_config.json and "
        "the chat template, which lm-evaluation-harness reads to tokenize through /tokenize "
        "rather than load a tokenizer from a hub (vLLM's is off unless asked for; behind "
        "--api-key like /tokenize)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests that may wait for a slot; beyond it, 429 with Retry-After",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )


def _add_stored_responses_args(group: argparse._ArgumentGroup) -> None:
    """Where /v1/responses keeps what `previous_response_id` and GET/DELETE find."""
    group.add_argument(
        "--responses-store",
        metavar="PATH",
        default=None,
        help="SQLite file of stored Responses (created with its directory if missing; "
        "several servers may share one); ':memory:' keeps them in memory only, gone at exit "
        "(default: $XDG_DATA_HOME/iterserve/responses.sqlite3, ~/.local/share when unset)",
    )
    group.add_argument(
        "--responses-retention",
        metavar="COUNT",
        type=int,
        default=Retention.max_count,
        help="stored Responses kept; beyond it the oldest are deleted as new ones are stored "
        "(0: no limit)",
    )
    group.add_argument(
        "--responses-max-age",
        metavar="DAYS",
        type=float,
        default=Retention.max_age_seconds / _DAY,
        help="days a stored Response is kept, as OpenAI keeps them (0: no limit)",
    )


def _add_data_parallel_args(dp: argparse._ArgumentGroup) -> None:
    dp.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas, each a Ray actor with its own weights, KV cache and scheduler, "
        "behind this one front end; by default they share this machine's cores (set "
        "--num-threads for each replica's share on other machines)",
    )
    dp.add_argument(
        "--router",
        choices=ROUTERS,
        default=None,
        help="how a request picks its replica (replicas/router.py, as `iterserve simulate "
        "--replicas`); default prefix-affinity when prefix caching is on (requests sharing "
        "a prompt prefix meet that prefix's cached blocks on one replica, within a load "
        "bound), else least-tokens (with no cache to find, balance is all that matters)",
    )
    dp.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (HEAD_IP:6379, or auto: $RAY_ADDRESS or this machine's "
        "latest) so replicas can span machines; 'local' starts a fresh one, as the default "
        "does, on demand. Given with --data-parallel-size 1, the one replica runs on Ray too",
    )
    dp.add_argument(
        "--replica-max-restarts",
        type=int,
        default=3,
        help="a replica that dies (process killed, out of memory, engine loop stopped) is "
        "restarted after 1, 2, 4... s, at most this many times in a row (a row ends after "
        "60 s of serving); then it stays down and /health says 'given up'. 0: never restart",
    )


def serve(args: argparse.Namespace) -> int:
    # Deferred: torch and the web stack load only for this subcommand.
    import uvicorn

    from iterserve.server.app import ServerSettings, create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    async_engine = launch_engine(args)
    settings = ServerSettings(
        api_key=args.api_key or os.environ.get("ITERSERVE_API_KEY") or None,
        # uvicorn already gave in-flight requests the full timeout before the app's
        # shutdown runs; what is left then is only a backstop.
        shutdown_timeout=min(5.0, args.shutdown_timeout),
        responses_store=args.responses_store or str(default_store_path()),
        responses_retention=Retention(args.responses_retention, args.responses_max_age * _DAY),
        tokenizer_info=args.enable_tokenizer_info_endpoint,
        **answer_settings(args),
    )
    logger.info("stored responses: %s", settings.responses_store)
    app = create_app(async_engine, settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Refuse new work (and fail /health) from the signal on, not only
            # once uvicorn has waited for open connections.
            async_engine.stop_accepting()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets)  # ends with the app's: the engine loop stops
            # Here rather than after run(): uvicorn re-raises the signal that stopped it
            # once run() is done, and the default SIGTERM handler would end this process
            # with the tensor-parallel workers never told to stop.
            await asyncio.to_thread(async_engine.close)

    uvicorn_config: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "access_log": False,  # iterserve.access writes one richer line per request
        "timeout_graceful_shutdown": args.shutdown_timeout,
    }
    logger.info(
        "serving %s on http://%s:%d/v1",
        settings.served_model_names or async_engine.served_model.name,
        args.host, args.port,
    )  # fmt: skip
    Server(uvicorn.Config(app, **uvicorn_config)).run()
    return 0


def answer_settings(args: argparse.Namespace) -> dict[str, Any]:
    """ServerSettings' fields of how answers are named and read (add_model_args' flags)."""
    return {
        "served_model_names": args.served_model_name or [],
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        "default_chat_template_kwargs": args.default_chat_template_kwargs,
        "trust_request_chat_template": args.trust_request_chat_template,
        "allowed_local_media_path": args.allowed_local_media_path,
        "allowed_media_domains": args.allowed_media_domains,
    }


def take_model_tag(args: argparse.Namespace) -> None:
    """`iterserve serve FILE` and `iterserve serve --model FILE` are one thing; both at once
    must agree."""
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise SystemExit(
            f"iterserve {args.command}: the model is given twice ({args.model_tag!r} and "
            f"--model {args.model!r}); give it once"
        )
    args.model = args.model_tag


def launch_engine(args: argparse.Namespace) -> ServingEngine:
    """The engine add_model_args' flags describe: one in this process, or
    --data-parallel-size replicas on Ray (Ray is imported only then). Either way a server's
    port opens once the weights are in, and /health says "warming up" until compiling is
    done."""
    take_model_tag(args)
    config = engine_config_from_args(args)
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 and config.enable_prompt_embeds:
        # The router places a prompt by its tokens; a prompt of rows has none.
        raise ValueError("--enable-prompt-embeds is not supported with --data-parallel-size > 1")
    if args.data_parallel_size == 1 and args.ray_address is None:
        from iterserve.engine.async_engine import AsyncEngine
        from iterserve.engine.llm_engine import LLMEngine

        # Built and warmed up on the engine's own thread (see AsyncEngine.launch); this
        # process serves it until it exits, so its startup heap is frozen once warm.
        return AsyncEngine.launch(
            lambda: LLMEngine(config, warm_up=False),
            freeze_heap=True,
            max_waiting_requests=args.max_waiting_requests,
        )
    from iterserve.replicas import ray_cluster
    from iterserve.replicas.data_parallel import DataParallelEngine
    from iterserve.replicas.router import make_router
    from iterserve.replicas.supervisor import RestartPolicy

    size = args.data_parallel_size
    restarts = RestartPolicy(max_restarts=args.replica_max_restarts)  # checked before Ray starts
    threads = ray_cluster.threads_per_replica(size, config.num_threads)
    router_name = args.router or (
        "prefix-affinity" if config.cache.enable_prefix_caching else "least-tokens"
    )
    # A local cluster gets room for every replica even when they outnumber the cores.
    cluster = ray_cluster.connect(args.ray_address, max(ray_cluster.local_cores(), size * threads))
    logger.info("routing over %d replicas with %s", size, router_name)
    return DataParallelEngine.launch(
        config,
        size,
        make_router(router_name, config.cache.block_size, config.seed),
        cluster,
        args.max_waiting_requests,
        threads,
        restarts,
    )
