"""Chat with a model in the browser: start an engine on it (or use a running one) and serve the Gradio chat.

    python apps/chat_app.py [--model DIR] [--host HOST] [--port PORT] [--title T] [engine options]
    python apps/chat_app.py --engine ipc:///run/nanostream.sock      # an engine `nanostream serve` runs

Without --model it starts an engine on the embedded demo model (a toy trained on the King James
Bible and fortune cookies: see nanostream/demo_model.py). Ctrl-C (or SIGTERM) stops the app, then the engine it started.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from nanostream.client.launch import EngineProcess
from nanostream.frontends.gradio_chat import GradioChat
from nanostream.options import add_engine_args, engine_kwargs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="Hugging Face model directory (default: the embedded demo model)")
    source.add_argument("--engine", help="address of a running engine to use instead of starting one")
    GradioChat.add_arguments(parser)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a service stop ends like Ctrl-C
    if args.engine:
        return GradioChat().run(args)

    if args.model is None:
        from nanostream.demo_model import default_model_dir

        args.model = str(default_model_dir())
    print(f"starting an engine on {args.model} ...", flush=True)
    engine = EngineProcess(args.model, **engine_kwargs(args))
    try:  # not `with`: Ctrl-C while the engine starts must stop it too
        engine.start()
        args.engine = engine.address
        return GradioChat().run(args)  # until Ctrl-C
    finally:
        print("stopping the engine ...", flush=True)
        engine.stop()


if __name__ == "__main__":
    sys.exit(main())
