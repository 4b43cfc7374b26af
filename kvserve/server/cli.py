"""``kvserve serve``: load a model, start the engine thread and serve the OpenAI API with uvicorn."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from kvserve.entrypoints.engine_args import (
    add_engine_args,
    add_schema_arg,
    add_tokenizer_args,
    check_model_fit,
    check_schemas,
    engine_config_from_args,
    register_schemas,
    run_worker_node,
)

DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


def add_serve_parser(sub: argparse._SubParsersAction, add_model_args: Callable) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (completions, chat, metrics)")
    serve.add_argument(
        "model_name", nargs="?", default=None, metavar="MODEL", help="the model, as --model takes it (either one)"
    )
    add_model_args(serve)
    add_tokenizer_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize (default: $KVSERVE_API_KEY); "
        "give it again for more keys: with two or more, each key has its own Prompt Cache schemas and "
        "prefix-cache blocks",
    )
    serve.add_argument(
        "--api-key-file", default=None, metavar="PATH", help="more API keys, one per line ('#' starts a comment)"
    )
    serve.add_argument(
        "--max-queue", type=int, default=None, help="most requests waiting + running; more get 503 (default: no limit)"
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest request body accepted; a larger one gets 413 before it is read (default: 4 MiB)",
    )
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=("hermes", "llama3_json", "mistral", "pythonic"),
        help="the syntax of the model's tool calls for tool_choice auto (default: the one its chat template "
        "teaches; for a template that renders no tools kvserve writes the tool prompt itself: pythonic for Gemma's, "
        "else hermes)",
    )
    add_engine_args(serve)
    add_schema_arg(serve)
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    serve.set_defaults(func=cmd_serve)


def model_from_args(positional: str | None, option: str | None) -> str | None:
    """``kvserve serve MODEL`` (as ``vllm serve MODEL``) or ``--model MODEL``; both only if they agree."""
    if positional is not None and option is not None and positional != option:
        raise ValueError(f"two models given: {positional!r} (MODEL) and {option!r} (--model); give one")
    return positional if positional is not None else option


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn  # the web stack loads only for this command

    from kvserve.core.engine import LLMEngine
    from kvserve.core.isolation import GLOBAL_NAMESPACE, key_namespaces
    from kvserve.entrypoints.cli_common import load_from_args
    from kvserve.server.api import build_app
    from kvserve.server.api_keys import ENV_VAR, read_api_keys
    from kvserve.server.async_engine import AsyncEngine
    from kvserve.server.body_limit import DEFAULT_MAX_REQUEST_BYTES
    from kvserve.server.metrics import ServerMetrics

    if args.max_queue is not None and args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    max_bytes = DEFAULT_MAX_REQUEST_BYTES if args.max_request_bytes is None else args.max_request_bytes
    if max_bytes < 1:
        raise ValueError(f"--max-request-bytes must be >= 1, got {max_bytes}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    args.model = model_from_args(args.model_name, args.model)
    api_keys = read_api_keys(args.api_key, args.api_key_file, os.environ.get(ENV_VAR))
    config = engine_config_from_args(args)
    node = run_worker_node(config)
    if node is not None:  # another machine of a tensor-parallel group: its ranks only
        return node
    check_schemas(config, args.schema)
    check_model_fit(config)
    engine = LLMEngine(config, load_from_args(args))
    for namespace in dict.fromkeys(key_namespaces(api_keys) or [GLOBAL_NAMESPACE]):
        register_schemas(engine, args.schema, namespace)  # with several keys, each gets its own copy
    path = engine.loaded.path
    name = args.served_model_name or args.model or DEFAULT_SERVED_NAME
    aliases = {str(path), str(path.resolve()), args.model or DEFAULT_SERVED_NAME}
    metrics = ServerMetrics(name)
    app = build_app(
        AsyncEngine(engine, metrics, args.max_queue), name, api_keys, aliases, str(path), max_bytes,
        tool_call_parser=args.tool_call_parser,
    )  # fmt: skip
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"kvserve: serving {name} at http://{host}:{args.port}/v1", file=sys.stderr)
    limits = f"context {engine.max_model_len} tokens, at most {config.max_num_seqs} sequences per step"
    queue = f", at most {args.max_queue} requests queued" if args.max_queue else ""
    queue += f", request bodies up to {max_bytes:,} bytes"
    keys = f"one of {len(api_keys)} API keys required" if len(api_keys) > 1 else "API key required"
    print(f"kvserve: {limits}{queue}; {keys if api_keys else 'API key not required'}", file=sys.stderr)
    if not api_keys and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"kvserve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        engine.close()  # prefill workers and offload threads stop now, not at interpreter exit
    return 0
