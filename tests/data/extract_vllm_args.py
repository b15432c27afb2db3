"""Records vLLM's engine arguments and `vllm serve` flags, the ground truth of tests/test_engine_args.py.

Writes tests/data/vllm_engine_args.json (every EngineArgs / AsyncEngineArgs field with its default, and
the keyword parameters of LLM.__init__) and tests/data/vllm_serve_flags.json (every option string of
`vllm serve`, with its group, default, nargs and choices), read from vLLM's own classes and parser
(`EngineArgs`, `AsyncEngineArgs`, `LLM.__init__`, `vllm.entrypoints.launchers.cli_args.make_arg_parser`).

vLLM need not be installed: its Python sources and the pure-Python packages its argument code imports are
enough (torch, transformers, pydantic, fastapi ... come from pagellm's own environment):

    pip download vllm==0.32.0 --no-deps -d /tmp/vllm
    mkdir -p /tmp/vllm/src && cd /tmp/vllm/src && unzip -q ../vllm-0.32.0-*.whl 'vllm/*.py'
    pip install --no-deps --target /tmp/vllmdeps cbor2 cachetools psutil blake3 msgspec py-cpuinfo pyzmq \
        pybase64 partial-json-parser ijson setproctitle cloudpickle einops aiohttp multidict attrs yarl \
        propcache aiohappyeyeballs aiosignal frozenlist openai-harmony uvloop llguidance
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=/tmp/vllm/src:/tmp/vllmdeps python tests/data/extract_vllm_args.py

(VLLM_TARGET_DEVICE=cpu only lets vLLM pick a platform without a GPU driver; no platform changes the
argument list or a default.)
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def encode_default(value: object) -> object:
    """A JSON form of a default: JSON values as they are, a config object as {"config": class name}."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return encode_default(value.value)
    if isinstance(value, (list, tuple)):
        return [encode_default(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(encode_default(v) for v in value)
    if isinstance(value, dict):
        return {str(k): encode_default(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"config": type(value).__name__}
    if value is dataclasses.MISSING or value is inspect.Parameter.empty:
        return {"required": True}
    return {"repr": repr(value)}


def field_default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        default = field.default
        factory = getattr(default, "default_factory", None)  # a pydantic Field(default_factory=...)
        if factory is not None:
            return factory()
        return getattr(default, "default", default) if type(default).__name__ == "FieldInfo" else default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def dataclass_fields(cls: type, skip: set[str] = frozenset()) -> list[dict]:
    return [
        {"name": f.name, "default": encode_default(field_default(f)), "type": str(f.type)}
        for f in dataclasses.fields(cls)
        if f.name not in skip and not f.name.startswith("_")
    ]


def serve_flags(parser: argparse.ArgumentParser) -> list[dict]:
    group_of = {id(action): group.title for group in parser._action_groups for action in group._group_actions}
    flags = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flags.append({
            "option_strings": list(action.option_strings),
            "dest": action.dest,
            "group": group_of.get(id(action)),
            "default": encode_default(action.default),
            "nargs": action.nargs,
            "choices": encode_default(list(action.choices)) if action.choices is not None else None,
            "takes_value": action.nargs != 0,
        })
    return flags


def main() -> None:
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.llm import LLM
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    provenance = {
        "vllm_version": vllm.__version__,
        "extracted_by": "tests/data/extract_vllm_args.py (see its docstring), from vLLM's own classes",
    }
    engine_fields = dataclass_fields(EngineArgs)
    engine_names = {f["name"] for f in engine_fields}
    llm_params = [
        {"name": name, "default": encode_default(param.default)}
        for name, param in inspect.signature(LLM.__init__).parameters.items()
        if name != "self" and param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL)
    ]
    engine = {
        **provenance,
        "engine_args": engine_fields,
        "async_engine_args": dataclass_fields(AsyncEngineArgs, skip=engine_names),
        "llm_init": llm_params,
    }
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    serve = {**provenance, "source": "make_arg_parser(FlexibleArgumentParser())", "flags": serve_flags(parser)}
    for name, payload in (("vllm_engine_args.json", engine), ("vllm_serve_flags.json", serve)):
        (HERE / name).write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
        print(f"wrote {HERE / name}", file=sys.stderr)


if __name__ == "__main__":
    main()
