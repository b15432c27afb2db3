"""`pagellm serve [MODEL]`: the OpenAI-compatible server, taking every flag `vllm serve` takes (made from the
argument tables: pagellm/config.py, engine/arg_utils.py, entrypoints/openai/cli_args.py); `pagellm worker`:
another host's share of a tensor-parallel engine; `pagellm quantize MODEL OUTPUT`: a compressed-tensors checkpoint of
an HF checkpoint, rounded by GPTQ (pagellm/compression)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

from pagellm.config import DEFAULT_MODEL, ArgumentValueError
from pagellm.engine.arg_utils import AsyncEngineArgs
from pagellm.entrypoints import openmp
from pagellm.entrypoints.arg_parser import FlexibleArgumentParser, flag_of, parse_size
from pagellm.entrypoints.openai import cli_args
from pagellm.entrypoints.openai.cli_args import FrontendArgs, frontend_args_from, load_chat_template, \
    make_arg_parser, server_config_kwargs

__all__ = ["build_parser", "engine_args_from", "main", "parse_size"]

_TABLE_NAMES = sorted({f.name for f in dataclasses.fields(AsyncEngineArgs)}
                      | {f.name for f in dataclasses.fields(FrontendArgs)}, key=len, reverse=True)


def build_parser() -> argparse.ArgumentParser:
    parser = FlexibleArgumentParser(prog="pagellm", description="pagellm: LLM serving on a paged KV cache.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API", usage="pagellm serve [model] [options]",
        description=f"Serve a model over an OpenAI-compatible HTTP API. The model is a local HF directory or .gguf "
                    f"file, a hub id already in the local Hugging Face cache, or unset for the embedded "
                    f"{DEFAULT_MODEL}.",
        epilog="On a CPU, torch's OpenMP threads spin briefly between kernels before they sleep (pagellm sets "
               "GOMP_SPINCOUNT unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set), and as many run as the affinity "
               "mask and the cgroup's CPU quota allow.")
    make_arg_parser(serve)
    # As before vLLM's names for them: torchrun's variables give the rendezvous flags their defaults.
    serve.set_defaults(**_rendezvous_defaults_from_environment())
    worker = commands.add_parser("worker", help="run this host's tensor-parallel ranks of an engine on another host")
    _add_worker_arguments(worker)
    quantize = commands.add_parser(
        "quantize", help="write a quantized (compressed-tensors) checkpoint of an HF checkpoint",
        usage="pagellm quantize model output [options]",
        description="Round an HF checkpoint's linear layers by GPTQ (or to nearest) into a compressed-tensors "
                    "checkpoint that pagellm and vLLM load. Calibration text: --calibration-file, or samples the "
                    "model writes itself.")
    _add_quantize_arguments(quantize)
    return parser


def _add_quantize_arguments(parser) -> None:
    from pagellm.compression.arguments import METHODS, SCHEMES, QuantizeArgs

    defaults = QuantizeArgs(model="", output="")
    parser.add_argument("model", help="an HF checkpoint directory (safetensors)")
    parser.add_argument("output", help="a new directory for the quantized checkpoint")
    parser.add_argument("--scheme", choices=sorted(SCHEMES), default=defaults.scheme,
                        help="FP8_DYNAMIC: fp8 weights per channel, fp8 activations per token; W8A8: the same in "
                             "int8; W4A16 / W4A16_ASYM / W8A16: weight-only int4 in groups of 128 (ASYM: with zero "
                             "points) / int8 per channel; NVFP4A16: weight-only e2m1 in groups of 16 with fp8 scales "
                             f"and a global scale per tensor (default: {defaults.scheme})")
    parser.add_argument("--method", choices=METHODS, default=defaults.method,
                        help=f"gptq: error-compensating rounding over calibration text; rtn: round to nearest, no "
                             f"calibration (default: {defaults.method})")
    parser.add_argument("--group-size", type=int, default=None,
                        help="inputs per scale of an int scheme (default: the scheme's: 128 for W4A16 and "
                             "W4A16_ASYM, per channel otherwise)")
    parser.add_argument("--calibration-file", action="append", default=[], dest="calibration_files",
                        help="a text file to calibrate on, cut into windows of --sample-length tokens (repeatable; "
                             "default: samples the model writes from its start token)")
    parser.add_argument("--num-samples", type=int, default=defaults.num_samples,
                        help=f"calibration sequences (default: {defaults.num_samples})")
    parser.add_argument("--sample-length", type=int, default=defaults.sample_length,
                        help=f"tokens per calibration sequence (default: {defaults.sample_length})")
    parser.add_argument("--dampening-frac", type=float, default=defaults.dampening_frac,
                        help=f"GPTQ's dampening, a fraction of the Hessian's mean diagonal (default: "
                             f"{defaults.dampening_frac})")
    parser.add_argument("--ignore", action="append", default=None,
                        help='a decoder layer\'s linear module left in float: a whole name, its last part, "re:" + '
                             'a regular expression, or Linear (repeatable; the LM head stays float always)')
    parser.add_argument("--seed", type=int, default=defaults.seed, help="the calibration samples' seed")


def _rendezvous_defaults_from_environment() -> dict:
    env, defaults = os.environ, {}
    for name, variable, parse in (("nnodes", "NNODES", int), ("node_rank", "NODE_RANK", int),
                                  ("master_addr", "MASTER_ADDR", str), ("master_port", "MASTER_PORT", int)):
        if variable in env:
            defaults[name] = parse(env[variable])
    return defaults


def _add_worker_arguments(parser) -> None:
    """`pagellm worker`'s flags (the other nodes'); defaults from torchrun's variables."""
    env = os.environ
    parser.add_argument("--nnodes", type=int, default=int(env.get("NNODES", 1)),
                        help="hosts the ranks are spread over, equally (default: $NNODES or 1)")
    parser.add_argument("--node-rank", type=int, default=int(env.get("NODE_RANK", 0)),
                        help="this host's index: 0 runs `pagellm serve`, 1.. run `pagellm worker` "
                             "(default: $NODE_RANK or 0)")
    parser.add_argument("--master-addr", default=env.get("MASTER_ADDR"),
                        help="address of node 0, where the ranks meet (default: $MASTER_ADDR)")
    parser.add_argument("--master-port", type=int, default=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None,
                        help="port of the rendezvous on node 0 (default: $MASTER_PORT)")
    parser.add_argument("--distributed-timeout-seconds", type=float, default=300.0,
                        help="how long ranks wait for each other at the rendezvous and in a step (default: 300)")


def engine_args_from(args: argparse.Namespace) -> AsyncEngineArgs:
    return cli_args.engine_args_from(args)


def with_flags(message: str) -> str:
    """An argument error as the command line spells it: the flags it is about, before the message."""
    named = []
    for name in _TABLE_NAMES:
        if re.search(rf"(?<![\w.-]){name}[=.\[]", message) and not any(name in other for other in named):
            named.append(name)
    return (", ".join(flag_of(name) for name in named) + ": " if named else "") + message


def serve(args: argparse.Namespace) -> None:
    try:  # bad flag values: say which before loading any model
        engine_args = engine_args_from(args)
        frontend = frontend_args_from(args)
        chat_template = load_chat_template(frontend.chat_template)
    except ArgumentValueError as exc:
        sys.exit(f"pagellm serve: {with_flags(str(exc))}")
    # Imported here, where they are needed: argument handling stays free of the server's imports.
    from pagellm.engine.async_llm_engine import AsyncLLMEngine
    from pagellm.entrypoints.openai.api_server import run_server
    from pagellm.entrypoints.openai.serving import ServerConfig
    from pagellm.distributed.launch import RendezvousError
    from pagellm.executor import ExecutorDeadError

    model_root = engine_args.model or DEFAULT_MODEL
    try:
        config = ServerConfig(
            engine_args.served_model_name or [model_root], model_root,
            max_request_body_bytes=frontend.max_request_body_bytes, shutdown_timeout=engine_args.shutdown_timeout,
            auto_tool_parser=frontend.tool_call_parser if frontend.enable_auto_tool_choice else None,
            chat_template=chat_template,
            **server_config_kwargs(frontend, {f.name for f in dataclasses.fields(ServerConfig)}),
        )
        if config.lora_modules and not engine_args.enable_lora:
            raise ValueError("--lora-modules serves LoRA adapters, which need --enable-lora.")
    except ValueError as exc:
        sys.exit(f"pagellm serve: {with_flags(str(exc))}")
    try:
        engine = AsyncLLMEngine.from_engine_args(engine_args)
    except (ValueError, RendezvousError, ExecutorDeadError) as exc:
        # A model that cannot load, a pool that cannot hold one request, ranks that cannot meet: say why.
        sys.exit(f"pagellm serve: {exc}")
    # The engine thread steps the model on an OpenMP team of its own; the loading team would only make libgomp
    # think the CPUs oversubscribed and cut every spin-wait short.
    openmp.release_thread_team()
    # vLLM's --host None listens on every interface.
    host = "0.0.0.0" if frontend.host is None else frontend.host
    run_server(engine, config, host, frontend.port, frontend.uvicorn_log_level)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        serve(args)
    elif args.command == "worker":
        worker(args)
    elif args.command == "quantize":
        quantize(args)


def quantize(args: argparse.Namespace) -> None:
    from pagellm.compression.arguments import QuantizeArgs
    from pagellm.compression.oneshot import quantize as write_quantized

    options = {name: value for name, value in vars(args).items() if name != "command" and value is not None}
    try:
        output = write_quantized(QuantizeArgs(**options))
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        sys.exit(f"pagellm quantize: {exc}")
    print(output)


def worker(args: argparse.Namespace) -> None:
    from pagellm.distributed.launch import RendezvousError, run_node

    if args.master_addr is None or args.master_port is None:
        sys.exit("pagellm worker: pass --master-addr and --master-port (node 0's address and rendezvous port).")
    try:
        status = run_node(args.node_rank, args.nnodes, args.master_addr, args.master_port,
                          args.distributed_timeout_seconds)
    except (RendezvousError, ValueError) as exc:
        sys.exit(f"pagellm worker: {exc}")
    sys.exit(status)


if __name__ == "__main__":
    main()
