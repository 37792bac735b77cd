"""`iterserve serve | generate | ...`: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from iterserve.cli import bench as bench_cli
from iterserve.cli import compare, flags_doc, run_batch, simulate
from iterserve.cli import serve as server_cli
from iterserve.cli.bench_fidelity import add_fidelity_parser
from iterserve.cli.bench_profile import add_profile_parser
from iterserve.config import add_engine_args, engine_config_from_args
from iterserve.sampling_params import InvalidRequestError, SamplingParams


def _generate(args: argparse.Namespace) -> int:
    from iterserve.engine.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    with LLM(config=engine_config_from_args(args)) as llm:
        if args.chat:
            outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].text)
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt and print the text")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_args(p)
    p.set_defaults(func=_generate)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    # `bench profile` and `bench fidelity` measure the real engine for the simulator.
    bench_cli.add_subcommands(sub, more_runners=(add_profile_parser, add_fidelity_parser))


# Subcommands register here; each module adds its parser and handler.
_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_generate,
    server_cli.add_subcommands,
    run_batch.add_subcommands,
    _add_bench,
    compare.add_subcommands,
    simulate.add_subcommands,
    flags_doc.add_subcommands,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iterserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (InvalidRequestError, ValueError, FileNotFoundError, ConnectionError) as err:
        print(f"iterserve: error: {err}", file=sys.stderr)
        return 2
