"""Command-line options drawn from the dataclasses that hold their defaults: one ``--option`` per
field of ``EngineConfig``, ``ServerConfig`` or ``SamplingParams``, described by the field's docstring,
with its choices and default. ``nanostream``'s commands, the terminal chat and the apps use them."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import textwrap
from typing import Any

from nanostream.config import ATTENTION_BACKENDS, DTYPES, KV_CACHE_DTYPES, LOAD_FORMATS, RUNNERS, EngineConfig
from nanostream.sampling_params import SamplingParams

_TYPES = {"int": int, "float": float, "str": str}
CHOICES = {
    "dtype": DTYPES,
    "attention_backend": ATTENTION_BACKENDS,
    "load_format": LOAD_FORMATS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "runner": RUNNERS,
}


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), as one line."""
    docs: dict[str, str] = {}
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    for node, after in itertools.pairwise(body):
        text = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(text, str):
            docs[node.target.id] = " ".join(text.split())
    return docs


def add_config_args(parser: argparse.ArgumentParser, cls: type, title: str, skip: tuple[str, ...] = ()) -> None:
    """One ``--option`` per field of a config dataclass, described by the field's docstring, with its
    choices and default; unset options keep the dataclass default."""
    group = parser.add_argument_group(title)
    docs = field_docs(cls)
    for field in dataclasses.fields(cls):
        if field.name == "model" or field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        base = str(field.type).replace(" | None", "")
        choices = CHOICES.get(field.name)
        default = "none" if field.default is None else field.default
        doc = f"{docs.get(field.name, '')} (default: {default})".strip().replace("%", "%%")
        if base == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=doc)
        else:
            group.add_argument(
                flag,
                type=_TYPES[base],
                choices=choices,
                default=argparse.SUPPRESS,
                metavar="{" + ",".join(choices) + "}" if choices else base.upper(),
                help=doc,
            )


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("give a JSON object, {...}")
    return value


def add_sampling_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One ``--option`` per ``SamplingParams`` field, described by its docstring; unset options keep its default."""
    group = parser.add_argument_group("sampling options (SamplingParams)")
    docs = field_docs(SamplingParams)
    for field in dataclasses.fields(SamplingParams):
        if field.name in skip:
            continue
        flag, dest = "--" + field.name.replace("_", "-"), "sampling_" + field.name
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        doc = f"{docs[field.name]} (default: {'none' if default in (None, ()) else default})".replace("%", "%%")
        common = dict(dest=dest, default=argparse.SUPPRESS, help=doc)
        base = str(field.type).replace(" | None", "")
        if base == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        elif field.name == "stop":
            common["help"] = doc + "; repeat for several"
            group.add_argument(flag, action="append", metavar="TEXT", **common)
        elif field.name == "stop_token_ids":
            group.add_argument(flag, nargs="+", type=int, metavar="ID", **common)
        elif field.name in ("logit_bias", "structured_outputs"):
            example = '{"42": -100}' if field.name == "logit_bias" else '{"regex": "[0-9]+"}'
            common["help"] = f"{doc}, as JSON: {example}"
            group.add_argument(flag, type=_json_object, metavar="JSON", **common)
        else:
            group.add_argument(flag, type=_TYPES[base], metavar=base.upper(), **common)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The ``SamplingParams`` of the sampling options given (``add_sampling_args``)."""
    from nanostream.structured_outputs import StructuredOutputsParams

    kwargs = {k[len("sampling_") :]: v for k, v in vars(args).items() if k.startswith("sampling_")}
    if "structured_outputs" in kwargs:
        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    if "logit_bias" in kwargs:
        kwargs["logit_bias"] = {int(k): v for k, v in kwargs["logit_bias"].items()}
    return SamplingParams(**kwargs)


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    add_config_args(parser, EngineConfig, "engine options", skip)


def config_kwargs(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)} - {"model"}
    return {k: v for k, v in vars(args).items() if k in names}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return config_kwargs(args, EngineConfig)
