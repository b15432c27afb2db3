"""`pagellm serve [MODEL]`: the OpenAI-compatible server, with flags named as `vllm serve` names them."""

from __future__ import annotations

import argparse
import os
import re
import sys

from pagellm.config import DEFAULT_MODEL
from pagellm.engine.arg_utils import DEFAULT_MAX_NUM_QUEUED_REQUESTS, AsyncEngineArgs
from pagellm.entrypoints import openmp
from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSERS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '268435456', '256MiB', '1.5G' (k/M/G/T are powers of 1000; Ki/Mi/Gi/Ti of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 268435456, 256MiB or 2G.")
    number, unit, binary = match.groups()
    power = "kmgt".find(unit.lower()) + 1 if unit else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm", description="pagellm: LLM serving on a paged KV cache.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        epilog="On a CPU, torch's OpenMP threads spin for a while between kernels before they sleep (libgomp's "
               "default, as offline): fastest on cores the server has to itself. Where other processes share the "
               "cores, OMP_WAIT_POLICY=PASSIVE holds up better.")
    serve.add_argument("model", nargs="?", default=None,
                       help=f"a local HF directory or .gguf file (default: the embedded {DEFAULT_MODEL})")
    server = serve.add_argument_group("server")
    # Loopback by default: exposing a model to the network should be a decision (--host 0.0.0.0).
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="the name(s) clients pass as `model`; the first is reported (default: MODEL)")
    server.add_argument("--api-key", default=os.environ.get("PAGELLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on API routes (default: $PAGELLM_API_KEY)")
    server.add_argument("--max-num-queued-requests", type=int, default=DEFAULT_MAX_NUM_QUEUED_REQUESTS,
                        help="requests that may wait for the engine before new ones get HTTP 429 "
                             f"(default: {DEFAULT_MAX_NUM_QUEUED_REQUESTS})")
    server.add_argument("--max-request-body-bytes", type=parse_size, default=None,
                        help="refuse bodies larger than this with HTTP 413, e.g. 4MiB (default: 64 bytes per token "
                             "of --max-model-len, at least 1 MiB)")
    server.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="on SIGINT/SIGTERM, seconds that running requests may go on (new ones get 503) before "
                             "their streams are ended (default: 10)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='answer tool_choice "auto" (the default with tools): the model calls tools in its own '
                             "format, which --tool-call-parser reads")
    server.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="the model family's tool-call format: hermes (Qwen2.5/Qwen3, Hermes, SmolLM3), "
                             "llama3_json (Llama 3.1/3.2), mistral")
    server.add_argument("--enable-server-load-tracking", action="store_true",
                        help="count the generating requests in flight, read at GET /load (as vLLM's)")
    server.add_argument("--enable-scale-out", action="store_true",
                        help="answer vLLM's /render endpoints (the token ids and sampling parameters a request would "
                             "run with); without it they answer 403, as vLLM's")
    server.add_argument("--responses-store-max-entries", type=int, default=1000,
                        help="/v1/responses kept for previous_response_id and GET, least recently used dropped "
                             "first (default: 1000)")
    server.add_argument("--responses-store-max-bytes", type=parse_size, default=64 << 20,
                        help="the most JSON bytes those stored responses may take, e.g. 256MiB (default: 64MiB)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    engine = serve.add_argument_group("engine")
    engine.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "float16", "half", "bfloat16"])
    engine.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--kv-cache-memory-bytes", type=parse_size, default=None,
                        help="exact KV pool size, e.g. 512MiB (overrides --gpu-memory-utilization)")
    engine.add_argument("--kv-prefault-seconds", type=float, default=1.0,
                        help="CPU: seconds of start-up spent faulting in the KV pool's first pages, so that the "
                             "first requests do not pay for them; the rest is faulted in while idle (default: 1.0)")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--max-num-batched-tokens", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV blocks of prompt prefixes seen before (default: on)")
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                        help="compute long prompts over several steps alongside running decodes (default: on)")
    engine.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights of the model's shape, for benchmarks without a checkpoint")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="run every step eagerly (no CUDA graphs)")
    parallel = serve.add_argument_group("tensor parallelism")
    parallel.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                          help="ranks (processes; one GPU each on CUDA) that split every layer (default: 1)")
    _add_rendezvous_arguments(parallel)
    worker = commands.add_parser("worker", help="run this host's tensor-parallel ranks of an engine on another host")
    _add_rendezvous_arguments(worker)
    return parser


def _add_rendezvous_arguments(group) -> None:
    """Flags shared by `serve` (node 0) and `worker` (the other nodes); defaults from torchrun's variables."""
    env = os.environ
    group.add_argument("--nnodes", type=int, default=int(env.get("NNODES", 1)),
                       help="hosts the ranks are spread over, equally (default: $NNODES or 1)")
    group.add_argument("--node-rank", type=int, default=int(env.get("NODE_RANK", 0)),
                       help="this host's index: 0 runs `pagellm serve`, 1.. run `pagellm worker` "
                            "(default: $NODE_RANK or 0)")
    group.add_argument("--master-addr", default=env.get("MASTER_ADDR"),
                       help="address of node 0, where the ranks meet (default: $MASTER_ADDR; 127.0.0.1 on one host)")
    group.add_argument("--master-port", type=int, default=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None,
                       help="port of the rendezvous on node 0 (default: $MASTER_PORT; a free port on one host)")
    group.add_argument("--distributed-timeout-seconds", type=float, default=300.0,
                       help="how long ranks wait for each other at the rendezvous and in a step (default: 300)")


def engine_args_from(args: argparse.Namespace) -> AsyncEngineArgs:
    return AsyncEngineArgs(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_prefault_seconds=args.kv_prefault_seconds,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        load_format=args.load_format,
        enforce_eager=args.enforce_eager,
        max_num_queued_requests=args.max_num_queued_requests,
        tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        distributed_timeout_seconds=args.distributed_timeout_seconds,
    )


def serve(args: argparse.Namespace) -> None:
    try:
        engine_args = engine_args_from(args)
    except ValueError as exc:  # a bad flag value: say which before loading any model
        sys.exit(f"pagellm serve: {exc}")
    # Imported here, where they are needed: argument handling stays free of the server's imports.
    from pagellm.engine.async_llm_engine import AsyncLLMEngine
    from pagellm.entrypoints.openai.api_server import run_server
    from pagellm.entrypoints.openai.serving import ServerConfig
    from pagellm.distributed.launch import RendezvousError
    from pagellm.executor import ExecutorDeadError

    model_root = args.model or DEFAULT_MODEL
    if args.shutdown_timeout < 0:
        sys.exit(f"pagellm serve: --shutdown-timeout={args.shutdown_timeout} must be >= 0 (seconds).")
    if args.responses_store_max_entries < 0:
        sys.exit(f"pagellm serve: --responses-store-max-entries={args.responses_store_max_entries} must be >= 0 "
                 "(0 keeps no responses).")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        sys.exit("pagellm serve: --enable-auto-tool-choice needs --tool-call-parser NAME, the model's tool-call "
                 f"format; NAME is one of {sorted(TOOL_PARSERS)}.")
    config = ServerConfig(args.served_model_name or [model_root], model_root, [args.api_key] if args.api_key else None,
                          args.max_request_body_bytes, args.shutdown_timeout,
                          auto_tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                          enable_server_load_tracking=args.enable_server_load_tracking,
                          enable_scale_out=args.enable_scale_out,
                          responses_store_max_entries=args.responses_store_max_entries,
                          responses_store_max_bytes=args.responses_store_max_bytes)
    try:
        engine = AsyncLLMEngine.from_engine_args(engine_args)
    except (ValueError, RendezvousError, ExecutorDeadError) as exc:
        # A model that cannot load, a pool that cannot hold one request, ranks that cannot meet: say why.
        sys.exit(f"pagellm serve: {exc}")
    # The engine thread steps the model on an OpenMP team of its own; the loading team would only make libgomp
    # think the CPUs oversubscribed and cut every spin-wait short.
    openmp.release_thread_team()
    run_server(engine, config, args.host, args.port, args.uvicorn_log_level)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        serve(args)
    elif args.command == "worker":
        worker(args)


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
