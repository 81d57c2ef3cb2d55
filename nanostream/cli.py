"""The ``nanostream`` command line.

    nanostream generate [PROMPT ...] [--model DIR] [--max-tokens N] [engine options]
    nanostream serve [MODEL] [--address ADDR] [--auth-token T] [server options] [engine options]
    nanostream make-tiny-model DIR
    nanostream frontend NAME [--engine ADDR] [its options]   (nanostream frontend --list)
    nanostream chat [--engine ADDR]
    nanostream demo [--prompts N] [--model DIR] [--gradio]

Engine options are generated from ``EngineConfig``'s fields, so the dataclass stays the one source
of their defaults.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from nanostream import discovery
from nanostream.client.launch import CACHE_LINE
from nanostream.client.reasoning import REASONING_PARSERS
from nanostream.config import EngineConfig, ServerConfig
from nanostream.errors import EngineDeadError, NanostreamError, RequestFailedError
from nanostream.options import add_config_args, add_engine_args, add_sampling_args, config_kwargs, engine_kwargs
from nanostream.options import sampling_params as sampling_params_of


def _generate(args: argparse.Namespace) -> int:
    from nanostream.demo_model import default_model_dir
    from nanostream.llm import LLM

    model = args.model or str(default_model_dir())
    params = sampling_params_of(args)  # a bad value: before the model loads
    llm = LLM(model, **engine_kwargs(args))
    prompts = args.prompts or ["In the beginning", "The meaning of life is"]
    for out in llm.generate(prompts, params, use_tqdm=not args.quiet):
        print(f"\n>>> {out.prompt}")
        for sample in out.outputs or [out]:
            print(f"{sample.text}\n[{len(sample.token_ids)} tokens, finish_reason={sample.finish_reason}]")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from nanostream.demo_model import default_model_dir
    from nanostream.distributed.rendezvous import Rendezvous, with_multicast_off
    from nanostream.engine.process.server import EngineFailure, EngineServer
    from nanostream.kernels.late_compiles import warn_on_late_compiles

    if args.model_option is not None:
        if args.model is not None and args.model != args.model_option:
            raise ValueError(f"two models given ({args.model} and --model {args.model_option}): give one")
        args.model = args.model_option
    server_kwargs = config_kwargs(args, ServerConfig)
    if args.openai_workers is not None and args.openai_port is None:
        raise ValueError("--openai-workers sets the OpenAI API's workers: give --openai-port too")
    if args.openai_port is not None or args.gradio_port is not None:
        from nanostream.service import run_service

        return run_service(args, args.model, {**server_kwargs, **engine_kwargs(args)})
    server_kwargs.setdefault("address", os.environ.get("NANOSTREAM_ADDRESS"))
    server_kwargs.setdefault("auth_token", os.environ.get("NANOSTREAM_AUTH_TOKEN"))
    server_config = ServerConfig(**server_kwargs)
    engine_config = EngineConfig.from_kwargs(args.model or str(default_model_dir()), **engine_kwargs(args))
    rendezvous = Rendezvous.from_env(os.environ)  # launched by torchrun (or as it would): one rank of several
    if rendezvous is not None or engine_config.tensor_parallel_size > 1:
        # NCCL's settings, for this process (an entry point) and the workers it starts (they take its environment)
        os.environ.update(with_multicast_off(os.environ))
    if rendezvous is not None:
        if rendezvous.world_size != engine_config.tensor_parallel_size:
            raise ValueError(
                f"WORLD_SIZE={rendezvous.world_size} but --tensor-parallel-size {engine_config.tensor_parallel_size}: "
                "give every rank --tensor-parallel-size equal to WORLD_SIZE"
            )
        if rendezvous.rank != 0:  # a worker: it takes every engine option from rank 0
            from nanostream.engine.tp.worker import run_worker

            return run_worker(rendezvous)
    server = EngineServer(engine_config, server_config, rendezvous)
    if server.engine.workers is not None:
        server.engine.workers.on_failure(_exit_if_stuck)

    record = []

    def ready(address: str) -> None:
        if server_config.register:  # found by local clients given no address, until this process stops
            record.append(discovery.register(address, engine_config.model))  # before "ready": then it is found
        print(f"{CACHE_LINE}{server.engine.runner.describe_cache()}", flush=True)  # before: `serve --*-port` relays it
        print(f"nanostream engine ready at {address}", flush=True)
        print(f"  clients: AsyncClient({address!r}) or NANOSTREAM_ADDRESS={address}", flush=True)
        if record:
            print("  local clients given no address (nanostream chat, AsyncClient()) find it", flush=True)

    # Everything loaded so far (torch, the model, compiled kernels: ~10^5 objects) lives as long as the
    # process: keep it out of the collector's full passes, which stalled a step for 280 ms on an H200.
    gc.collect()
    gc.freeze()
    warn_on_late_compiles()  # start-up is over: a kernel built from now on stalled the streams
    try:
        server.serve_forever(ready)
    except (EngineFailure, EngineDeadError) as exc:  # the clients were told; the process says so and exits non-zero
        print(f"nanostream serve: {exc}", file=sys.stderr)
        return 1
    finally:
        for path in record:
            discovery.unregister(path)
    return 130 if server.stopped_by == signal.SIGINT else 0  # Ctrl-C, as a shell counts it; SIGTERM: 0


STUCK_GRACE = 10.0
"""Seconds the engine loop gets to shut down once a tensor-parallel worker is seen dead or hung."""


def _exit_if_stuck(reason: str) -> None:
    """A worker died or hung: the engine loop shuts down on its own unless it waits in a collective with a rank
    nothing here can kill (another host's). Then the process exits, and its clients see it gone."""

    def check() -> None:
        print(f"nanostream serve: {reason}; the engine did not stop within {STUCK_GRACE:g} s, exiting", file=sys.stderr)
        os._exit(1)

    timer = threading.Timer(STUCK_GRACE, check)
    timer.daemon = True  # the process ending on its own (the usual case) cancels it
    timer.start()


def _workers(value: str) -> str:
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise argparse.ArgumentTypeError(f"expected a number of workers (1 or more) or auto, got {value!r}")
    return value


def _make_tiny_model(args: argparse.Namespace) -> int:
    from nanostream.testing import make_tiny_model

    path = make_tiny_model(args.dir, architecture=args.architecture, seed=args.seed)
    print(f"wrote a tiny random {args.architecture} model to {path}")
    return 0


def _frontend(args: argparse.Namespace) -> int:
    from nanostream.frontends import frontend_main, load, registered

    if args.list or not args.name:
        for name in sorted(registered()):
            try:
                description = load(name).description
            except Exception as exc:  # a broken third-party plug-in must not hide the others
                description = f"(cannot be loaded: {exc})"
            print(f"{name:12} {description}")
        return 0
    return frontend_main(args.name, args.args)


def _chat(args: argparse.Namespace) -> int:
    from nanostream.frontends import frontend_main

    return frontend_main("chat", args.args, prog="nanostream chat")


def _demo(args: argparse.Namespace) -> int:
    from nanostream.frontends.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    from nanostream import __version__

    parser = argparse.ArgumentParser(prog="nanostream", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"nanostream {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also NANOSTREAM_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate completions offline, in this process")
    gen.add_argument("prompts", nargs="*", help="prompts (default: two short examples)")
    gen.add_argument("--model", help="Hugging Face model directory (default: the embedded demo model)")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    add_sampling_args(gen)
    add_engine_args(gen, skip=("seed",))  # --seed is the requests' (the engine's seeds only requests without one)
    gen.set_defaults(func=_generate)

    serve = commands.add_parser("serve", help="run an engine process that clients connect to")
    serve.add_argument("model", nargs="?", help="Hugging Face model directory (default: the embedded demo model)")
    serve.add_argument("--model", dest="model_option", metavar="MODEL", help="the same, as generate and demo take it")
    service = serve.add_argument_group("frontends: serve them with the engine, as one service")
    service.add_argument("--openai-port", type=int, help="serve the OpenAI-compatible API on this port")
    service.add_argument("--gradio-port", type=int, help="serve the Gradio chat on this port")
    service.add_argument(
        "--host", default="127.0.0.1", help="the frontends' interface; 0.0.0.0 for every one (default %(default)s)"
    )
    service.add_argument(
        "--api-key",
        default=os.environ.get("NANOSTREAM_API_KEY"),
        help="the OpenAI API's key (default: $NANOSTREAM_API_KEY)",
    )
    service.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        help="the OpenAI API's reasoning parser (qwen3: <think> as reasoning_content)",
    )
    service.add_argument("--tool-call-parser", help="the OpenAI API's tool-call parser (default: hermes; none)")
    service.add_argument(
        "--allowed-media-domains", nargs="+", metavar="DOMAIN", help="the OpenAI API's image URLs' hosts"
    )
    service.add_argument("--allowed-local-media-path", metavar="DIR", help="the OpenAI API's images from local files")
    for what in ("responses", "response-bytes"):  # (defaults: the frontend's; `nanostream frontend openai --help`)
        service.add_argument(f"--max-stored-{what}", type=int, help=f"the Responses API's store: its most {what}")
    service.add_argument(
        "--openai-workers",
        type=_workers,
        metavar="N|auto",
        help="the OpenAI API's server processes on its one port (default auto: one per 32 of --max-num-seqs, "
        "since a worker streams about 5,000 events/s; at most half this machine's cores, at least 1)",
    )
    add_config_args(serve, ServerConfig, "server options (NANOSTREAM_ADDRESS / NANOSTREAM_AUTH_TOKEN as defaults)")
    add_engine_args(serve)
    serve.set_defaults(func=_serve)

    tiny = commands.add_parser("make-tiny-model", help="write a tiny random-weight model directory")
    tiny.add_argument("dir")
    tiny.add_argument(  # checked by make_tiny_model: importing it here would load torch for every command
        "--architecture",
        default="Qwen3ForCausalLM",
        help="Qwen3ForCausalLM (default), Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM, "
        "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM or MixtralForCausalLM",
    )
    tiny.add_argument("--seed", type=int, default=0, help="seeds the random weights (default: 0)")
    tiny.set_defaults(func=_make_tiny_model)

    frontend = commands.add_parser(
        "frontend", help="run a registered frontend against an engine", add_help=False, prefix_chars="\0"
    )
    frontend.add_argument("name", nargs="?", help="the frontend (nanostream frontend --list)")
    frontend.add_argument("args", nargs=argparse.REMAINDER, help="--engine ADDR and the frontend's own options")
    frontend.set_defaults(func=_frontend, list=False)

    chat = commands.add_parser("chat", help="chat in the terminal with an engine", add_help=False, prefix_chars="\0")
    chat.add_argument("args", nargs=argparse.REMAINDER)
    chat.set_defaults(func=_chat)

    from nanostream.frontends.demo import add_demo_arguments

    demo = commands.add_parser("demo", help="an engine and several streaming clients in one live terminal view")
    add_demo_arguments(demo)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 done, 1 a runtime failure (the engine died, a service child exited), 2 a usage
    error (the message says what to change), 130 Ctrl-C. Tracebacks only with ``--debug`` or
    ``NANOSTREAM_DEBUG=1``."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("NANOSTREAM_DEBUG", "") not in ("", "0")
    if args.command == "frontend" and args.name in ("--list", "-l", "--help", "-h"):
        args.list, args.name = args.name in ("--list", "-l"), None
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(file=sys.stderr)
        return 130
    except (EngineDeadError, RequestFailedError) as exc:  # what ran failed: nothing to change in the command
        if debug:
            raise
        print(f"nanostream: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, NanostreamError) as exc:  # bad options or input: say what to change
        if debug:
            raise
        print(f"nanostream: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if debug:
            raise
        print(f"nanostream: {type(exc).__name__}: {exc} (NANOSTREAM_DEBUG=1 or --debug shows where)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
