"""Command line: `nanovllm {serve,generate,chat,bench}` (also `python -m nanovllm ...`).

With no model the embedded default model (SmolLM2-135M-Instruct, GGUF) is used. Generated text
goes to stdout; progress and logs go to stderr, so the output can be piped. Heavy imports (torch,
FastAPI) happen inside the subcommands, so `--help` is instant.

`serve` runs the engine core in a child process and the HTTP front-end(s) against it. It exits
0 on SIGINT/SIGTERM: uvicorn stops accepting, in-flight requests get --shutdown-timeout seconds
to finish, then the engine aborts the rest (streams end with finish_reason "abort", unstreamed
requests get a 503), then the core is stopped. uvicorn re-raises the signal it caught once it
is done (to give the default behaviour, death by signal); we install our own handlers around it
so the process exits 0. It exits 1 if the engine core dies.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from typing import Sequence


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0..65535 (0: a free one, which the log names)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0..65535)")
    return port


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine options mirroring LLM(...)'s keyword arguments."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash-attn"])
    g.add_argument("--tensor-parallel-size", type=int, default=1)
    _add_multinode_args(g)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--max-model-len", type=int, default=None,
                   help="the longest sequence, prompt and output (default: the model's context, at most 4096)")
    g.add_argument("--max-num-seqs", type=int, default=512)
    g.add_argument("--max-num-batched-tokens", type=int, default=16384)
    g.add_argument("--kvcache-block-size", type=int, default=16)
    g.add_argument("--num-kvcache-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const", const=False, default=None,
                   help="wait for each step's tokens before scheduling the next (default: async on CUDA)")
    g.add_argument("--no-persistent-decode", dest="persistent_decode", action="store_false",
                   help="a lone sequence decodes through the per-op CUDA graph, not the persistent kernel")
    g.add_argument("--decode-burst", type=int, default=None,
                   help="decode steps a lone decoding sequence (no grammar, logprobs or min_tokens ban) runs per "
                        "engine step (default: 8 with the persistent kernel or the compiled CPU decode, else 1)")
    g.add_argument("--cpu-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU only: decode steps (every sequence one token) run each layer as code compiled ahead "
                        "of time (faster per token; built at start-up the first time for a model shape, then "
                        "cached). Default: on where a C++ compiler is found, except for `generate`")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="vLLM's flag: 'auto' (default) takes the model's sampling defaults (generation_config.json "
                        "or GGUF general.sampling.* metadata) for every sampling option not given; 'none' ignores them")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="'dummy': random weights from config.json alone, no checkpoint read (benchmarks)")
    g.add_argument("--quantization", default=None, choices=["int4"],
                   help="CPU only: int4 weights with bf16 activations (faster single-stream decode, approximate); "
                        "the default for a quantized GGUF file at --dtype auto (--dtype float32: the fp32 model)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = (
        "device", "attention_backend", "tensor_parallel_size", "dtype", "max_model_len", "max_num_seqs",
        "max_num_batched_tokens", "kvcache_block_size", "num_kvcache_blocks", "gpu_memory_utilization",
        "enable_prefix_caching", "enforce_eager", "seed", "async_scheduling", "persistent_decode", "decode_burst",
        "quantization", "nnodes", "master_addr", "master_port", "join_timeout_s", "generation_config",
        "load_format", "cpu_compile",
    )
    return {n: getattr(args, n) for n in names} | {"torchrun": getattr(args, "torchrun", False)}


def _add_multinode_args(g) -> None:
    """Tensor parallelism across machines (docs/scaling.md): this process is node 0."""
    g.add_argument("--nnodes", type=int, default=1,
                   help="machines the --tensor-parallel-size ranks span; the others run `nanovllm worker`")
    g.add_argument("--master-addr", default="127.0.0.1",
                   help="multi-node: node 0's address as the other nodes reach it")
    g.add_argument("--master-port", type=int, default=0,
                   help="multi-node: the rendezvous port node 0 opens (single node: 0 = a free one)")
    g.add_argument("--join-timeout", dest="join_timeout_s", type=float, default=300.0,
                   help="multi-node: seconds to wait for every node's ranks to join before failing")


# ---- worker (a node other than node 0 in multi-node tensor parallelism) ------------------------
def cmd_worker(args: argparse.Namespace) -> int:
    from nanovllm.executor.multinode import NodeError, run_node

    try:
        return run_node(args.nnodes, args.node_rank, args.master_addr, args.master_port, args.join_timeout_s)
    except NodeError as exc:
        print(f"nanovllm worker: error: {exc}", file=sys.stderr)
        return 1


# ---- torchrun (every rank started by torchrun, running the same command) -----------------------
def _torchrun_launch(args: argparse.Namespace) -> bool:
    """Under torchrun, fill the engine's tensor-parallel options from its environment (given flags
    must agree with it); True when this process is a rank other than 0, which serves steps only."""
    if not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} <= os.environ.keys():
        return False
    from nanovllm.executor.multinode import torchrun_env

    env = torchrun_env()
    if env is None:
        return False
    for name, value in (("tensor_parallel_size", env.world), ("nnodes", env.nnodes)):
        given = getattr(args, name)
        if given != 1 and given != value:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {given} disagrees with torchrun's launch ({value}); leave it out under torchrun")
    args.tensor_parallel_size, args.nnodes = env.world, env.nnodes
    args.master_addr, args.master_port, args.torchrun = env.master_addr, env.master_port, True
    args.torchrun_env = env
    return env.rank != 0


def run_torchrun_rank(args: argparse.Namespace) -> int:
    from nanovllm.executor.multinode import NodeError, run_torchrun_rank as serve_rank

    try:
        return serve_rank(args.torchrun_env, args.join_timeout_s)
    except NodeError as exc:
        print(f"nanovllm: rank {args.torchrun_env.rank}: error: {exc}", file=sys.stderr)
        return 1


def _model_arg(args: argparse.Namespace) -> str | None:
    """The model given positionally or with --model (not both, unless they agree)."""
    positional = getattr(args, "model_pos", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"two models given: {positional!r} and --model {args.model!r}")
    return positional if positional is not None else args.model


# Sampling options: flag -> (SamplingParams field, type, the CLI's own default). An option not
# given takes the model's default (--generation-config auto), else this one.
SAMPLING_FLAGS = {
    "--temperature": ("temperature", float, 0.0),
    "--top-p": ("top_p", float, 1.0),
    "--top-k": ("top_k", int, -1),
    "--min-p": ("min_p", float, 0.0),
    "--presence-penalty": ("presence_penalty", float, 0.0),
    "--frequency-penalty": ("frequency_penalty", float, 0.0),
    "--repetition-penalty": ("repetition_penalty", float, 1.0),
}


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group(
        "sampling", "An option not given takes the model's default where it has one (--generation-config auto: "
                    "its generation_config.json or GGUF sampling metadata), else the default shown.")
    g.add_argument("--max-tokens", type=int, default=None, help=f"default {max_tokens}")
    parser.set_defaults(cli_max_tokens=max_tokens)
    for flag, (name, kind, default) in SAMPLING_FLAGS.items():
        extra = " (0 = greedy)" if name == "temperature" else ""
        g.add_argument(flag, dest=name, type=kind, default=None, help=f"default {default:g}{extra}")
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace, model_defaults: dict):
    """The flags given, else the model's defaults (`model_defaults`: LLMEngine.generation_defaults),
    else the CLI's own; ValueError naming the field for a bad value."""
    from nanovllm import SamplingParams

    kwargs = {name: default for name, _, default in SAMPLING_FLAGS.values()}
    kwargs["max_tokens"] = args.cli_max_tokens
    kwargs.update(model_defaults)
    given = {name: getattr(args, name) for name, _, _ in SAMPLING_FLAGS.values()}
    given["max_tokens"] = args.max_tokens
    kwargs.update({k: v for k, v in given.items() if v is not None})
    return SamplingParams(**kwargs, seed=args.sample_seed, ignore_eos=args.ignore_eos)


def _set_threads(args: argparse.Namespace) -> None:
    """torch's CPU threads for a one-shot command (entrypoints/cpu_threads.py)."""
    from nanovllm.entrypoints.cpu_threads import command_threads

    threads = command_threads(args.threads)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _add_threads_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's CPU threads (default: OMP_NUM_THREADS, else the cores the 1-minute load "
                             "average leaves free, less one, at least 1)")


# ---- generate --------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from nanovllm.gc_pause import collections_paused

    with collections_paused():  # importing torch: see gc_pause.py
        from nanovllm import LLM
        from nanovllm.entrypoints.startup_report import format_rows, process_age, startup_rows

    _set_threads(args)
    import_s = process_age()
    t0 = time.perf_counter()
    kwargs = engine_kwargs(args)
    if kwargs["cpu_compile"] is None and os.environ.get("NANOVLLM_CPU_COMPILE") is None:
        kwargs["cpu_compile"] = False  # a one-shot answer does not wait for the compiled decode's build
    llm = LLM(args.model, **kwargs)
    t1 = time.perf_counter()
    params = _sampling_params(args, llm.engine.generation_defaults)
    prompts = args.prompt or [sys.stdin.read()]
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=not args.quiet)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
        t2 = time.perf_counter()
        for out in outputs:
            sys.stdout.write(out.outputs[0].text + "\n")
        sys.stdout.flush()
        if args.verbose:
            ttft = llm.last_ttft_stats["max"] if llm.last_ttft_stats else None
            rows = startup_rows(llm, import_s=import_s, engine_s=t1 - t0, first_token_s=ttft, generate_s=t2 - t1)
            print(format_rows(rows), file=sys.stderr)
    finally:
        llm.shutdown()
    return 0


# ---- serve -----------------------------------------------------------------------------------
def _served_name(source_path: str) -> str:
    name = os.path.basename(os.path.normpath(source_path))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def cmd_serve(args: argparse.Namespace) -> int:
    """The engine core in a child process, the HTTP front-end in this one or, with
    --api-server-count N > 1, in N child processes sharing the port (docs/server.md)."""
    from nanovllm.engine.core import CoreProcess
    from nanovllm.entrypoints.limits import fit_to_fd_limit, limits_from_args, raise_fd_limit, warn_open_host

    if args.api_server_count < 1:
        raise ValueError("--api-server-count must be >= 1")
    for flag, value, ok, rule in (("--max-pending-requests", args.max_pending_requests, lambda v: v >= 1, ">= 1"),
                                  ("--max-prompt-chars", args.max_prompt_chars, lambda v: v >= 1, ">= 1"),
                                  ("--shutdown-timeout", args.shutdown_timeout, lambda v: 0 <= v < math.inf, ">= 0"),
                                  ("--stream-write-timeout", args.stream_write_timeout, lambda v: 0 < v < math.inf,
                                   "> 0")):
        if value is not None and not ok(value):  # (a NaN is refused too)
            raise ValueError(f"{flag} must be a finite number {rule}, got {value}")
    from nanovllm.entrypoints.frontend import check_port_free

    check_port_free(args.host, args.port)  # before the model loads
    model = _model_arg(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get("NANOVLLM_API_KEY")
    limits = fit_to_fd_limit(limits_from_args(args), raise_fd_limit())  # docs/server.md, limits
    warn_open_host(args.host, api_key, limits)
    parsers = parsers_from_args(args)
    kwargs = engine_kwargs(args)
    max_pending = args.max_pending_requests or 4 * max(args.max_num_seqs, 256)
    metrics_dir = None
    if args.api_server_count > 1:  # before prometheus_client is imported anywhere
        metrics_dir = tempfile.mkdtemp(prefix="nanovllm-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    core = CoreProcess(model, kwargs, max_pending)
    try:
        from nanovllm.entrypoints.frontend import FrontendConfig, run_frontend

        name = args.served_model_name or _served_name(core.info.model_path)
        logging.getLogger("nanovllm").info("serving the model as %r", name)
        cfg = FrontendConfig(core.addresses, core.info, name, api_key or None, args.host, args.port,
                             args.shutdown_timeout, args.log_level, args.access_log, args.max_prompt_chars,
                             args.stream_write_timeout, limits, parsers)
        if args.api_server_count == 1:
            return run_frontend(cfg, core_alive=core.is_alive)
        return _run_frontends(cfg, args.api_server_count, core)
    finally:
        core.shutdown()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def parsers_from_args(args: argparse.Namespace):
    """The tool-call and reasoning parsers of `serve` (a ParserConfig)."""
    from nanovllm.entrypoints.tools import ParserConfig

    return ParserConfig(args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser)


def _run_frontends(cfg, count: int, core) -> int:
    """Start `count` front-end processes on one port and supervise them: SIGINT/SIGTERM is
    forwarded (graceful stop, status 0); a front-end that dies alone is restarted; when the core
    dies they fail their requests and exit, and so do we (status 1)."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    from nanovllm.entrypoints.frontend import frontend_process_main, reuseport_socket

    # Hold the port (bound, not listening) so --port 0 gives every front-end the same one.
    holder = reuseport_socket(cfg.host, cfg.port)
    cfg.port = holder.getsockname()[1]
    ctx = mp.get_context("spawn")
    stopping: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, f: stopping.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}

    def start() -> mp.Process:
        proc = ctx.Process(target=frontend_process_main, args=(cfg, os.getpid()), name="nanovllm-frontend")
        proc.start()
        return proc

    procs = [start() for _ in range(count)]
    logging.getLogger("nanovllm").info("%d front-ends on http://%s:%d", count, cfg.host, cfg.port)
    forwarded = False
    try:
        while any(p.is_alive() for p in procs):
            if stopping and not forwarded:
                forwarded = True
                for p in procs:
                    if p.is_alive():
                        p.terminate()  # SIGTERM: graceful
            wait([p.sentinel for p in procs if p.is_alive()], timeout=0.2)
            for i, p in enumerate(procs):
                if not p.is_alive() and not stopping and core.is_alive() and p.exitcode != 0:
                    logging.getLogger("nanovllm").error("front-end %d exited with %s: restarting it", i, p.exitcode)
                    procs[i] = start()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in procs:
            p.join(cfg.shutdown_timeout + 10)
            if p.is_alive():
                p.kill()
                p.join()
        holder.close()
    return 0 if stopping and not any(p.exitcode for p in procs) else 1


# ---- chat ------------------------------------------------------------------------------------
def cmd_chat(args: argparse.Namespace) -> int:
    from nanovllm.gc_pause import collections_paused

    with collections_paused():  # importing torch: see gc_pause.py
        from nanovllm import LLM
        from nanovllm.chat import chat_prompt_ids

    _set_threads(args)
    llm = LLM(_model_arg(args), **engine_kwargs(args))
    params = _sampling_params(args, llm.engine.generation_defaults)
    tok = llm.tokenizer
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    interactive = sys.stdin.isatty()
    if interactive:
        print("chat: /exit or Ctrl-D to quit, /reset to clear the conversation, Ctrl-C stops a reply",
              file=sys.stderr)
    try:
        while True:
            try:
                line = input(">>> ") if interactive else sys.stdin.readline()
            except EOFError:
                break
            except KeyboardInterrupt:  # Ctrl-C at the prompt quits, as Ctrl-D does
                print(file=sys.stderr)
                break
            if not interactive and line == "":
                break
            line = line.strip()
            if line in ("/exit", "/quit"):
                break
            if line == "/reset":
                history = list(base)
                continue
            if not line:
                continue
            history.append({"role": "user", "content": line})
            try:
                ids = chat_prompt_ids(tok, history)  # special-token text typed stays text
                reply = _stream_reply(llm, ids, params)
            except ValueError as exc:  # e.g. the conversation outgrew max_model_len
                print(f"error: {exc}", file=sys.stderr)
                history.pop()
                continue
            history.append({"role": "assistant", "content": reply})
    finally:
        llm.shutdown()
    return 0


def _stream_reply(llm, prompt_ids: list[int], params) -> str:
    """Print a reply as it is generated; Ctrl-C stops it (the request is aborted)."""
    printed = ""
    stream = llm.stream(prompt_ids, params)
    try:
        for out in stream:
            text = out.outputs[0].text
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    except KeyboardInterrupt:
        sys.stdout.write(" [stopped]")
    finally:
        stream.close()  # aborts the request if it is still running
        sys.stdout.write("\n")
        sys.stdout.flush()
    return printed


# ---- bench -----------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    if args.serving:
        from nanovllm.entrypoints.serve_bench import run_from_args

        return run_from_args(args)
    from nanovllm import LLM, SamplingParams

    for lo, hi, what in ((args.min_input_len, args.max_input_len, "input"), (args.min_output_len, args.max_output_len, "output")):
        if not 1 <= lo <= hi:
            raise ValueError(f"need 1 <= --min-{what}-len <= --max-{what}-len")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    llm = LLM(_model_arg(args), **engine_kwargs(args))
    try:
        # W1 (docs/benchmarks.md): random.seed(0), random token prompts, random output lengths, EOS ignored.
        random.seed(0)
        top = min(10000, llm.engine.vocab_size - 1)  # W1 draws ids from randint(0, 10000)
        prompts = [[random.randint(0, top) for _ in range(random.randint(args.min_input_len, args.max_input_len))]
                   for _ in range(args.num_prompts)]
        params = [SamplingParams(temperature=0.6, ignore_eos=True,
                                 max_tokens=random.randint(args.min_output_len, args.max_output_len))
                  for _ in range(args.num_prompts)]
        llm.generate(["Benchmark: "], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet)
        seconds = time.perf_counter() - start
    finally:
        llm.shutdown()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(p) for p in prompts)
    if getattr(args, "json", False):
        print(json.dumps({"requests": len(prompts), "prompt_tokens": in_tokens, "output_tokens": out_tokens,
                          "seconds": round(seconds, 3), "output_tok_per_s": round(out_tokens / seconds, 1)}))
    else:
        print(f"requests: {len(prompts)}  prompt tokens: {in_tokens}  output tokens: {out_tokens}  "
              f"time: {seconds:.2f}s  throughput: {out_tokens / seconds:.1f} tok/s")
    return 0


# ---- parser ----------------------------------------------------------------------------------
def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; given `command`, only that one's options are added in
    full (the others' import modules it does not need), the rest keep their names and help."""
    parser = argparse.ArgumentParser(prog="nanovllm", description="nano-vllm: a small, fast LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="*", help="prompt text (read from stdin when none is given)")
    _add_sampling_args(gen, max_tokens=64)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.add_argument("--verbose", action="store_true", help="print where the time went (start-up table) to stderr")
    _add_threads_arg(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description="Serve OpenAI's /v1/completions, /v1/chat/completions and /v1/models, vLLM's "
                           "/tokenize, /detokenize and /version, /health and /metrics (see docs/server.md).")
    if command in (None, "serve"):  # its options import the tool-call and reasoning parsers
        _add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="interactive chat in the terminal (streams the reply)",
                          description="Chat with the model using its chat template; the conversation is kept. "
                          "Type /exit (or Ctrl-D) to quit, /reset to start over.")
    chat.add_argument("model_pos", nargs="?", metavar="MODEL", help="model path (or use --model)")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_threads_arg(chat)
    _add_sampling_args(chat, max_tokens=512)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    worker = sub.add_parser("worker", help="run this machine's ranks of a multi-node tensor-parallel engine",
                            description="Node K > 0 of a model spread over --nnodes machines: joins node 0 (which runs "
                            "`nanovllm serve --nnodes N --master-addr A --master-port P ...`), takes the model and "
                            "engine settings from it, and runs its ranks until node 0 stops (docs/scaling.md).")
    worker.add_argument("--node-rank", type=int, required=True, help="this machine's index, 1..nnodes-1")
    _add_multinode_args(worker)
    worker.set_defaults(func=cmd_worker)

    bench = sub.add_parser("bench", help="offline throughput (W1) or, with --serving, a serving load (W4)",
                           description="Without --serving: W1 from docs/benchmarks.md (random token prompts, "
                           "temperature 0.6, EOS ignored) on a model in this process. With --serving: N concurrent "
                           "streaming clients against a running server on this machine.")
    if command in (None, "bench"):  # its options import the serving benchmark (asyncio)
        _add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def _add_serve_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("model_pos", nargs="?", metavar="MODEL", help="model path (or use --model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=port_number, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $NANOVLLM_API_KEY, else none)")
    serve.add_argument("--served-model-name", default=None, help="model name clients use (default: the file/directory name)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGINT/SIGTERM, seconds to let in-flight requests finish before aborting them")
    serve.add_argument("--api-server-count", type=int, default=1,
                       help="HTTP front-end processes sharing the port (SO_REUSEPORT), one engine core")
    serve.add_argument("--max-pending-requests", type=int, default=None,
                       help="requests queued or running in the engine before new ones get 503 with Retry-After "
                            "(default: 4 x max(--max-num-seqs, 256))")
    serve.add_argument("--max-prompt-chars", type=int, default=None,
                       help="longer prompts are refused before tokenizing (default: --max-model-len x 16)")
    serve.add_argument("--stream-write-timeout", type=float, default=60.0,
                       help="seconds a stream waits for a client that reads nothing before dropping it and "
                            "aborting its request")
    from nanovllm.entrypoints.reasoning import PARSERS as REASONING_PARSERS
    from nanovllm.entrypoints.tool_parsers import PARSERS as TOOL_PARSERS

    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model call tools on its own (tool_choice "auto", the default with tools)')
    serve.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how tool calls are written in the output (default with --enable-auto-tool-choice: "
                            "read from the chat template)")
    serve.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                       help="return <think>...</think> as reasoning_content")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--access-log", action="store_true", help="log every HTTP request")
    from nanovllm.entrypoints.limits import add_limit_args

    add_limit_args(serve)
    add_engine_args(serve)


def _add_bench_args(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("model_pos", nargs="?", metavar="MODEL", help="model path (or use --model)")
    bench.add_argument("--num-prompts", type=int, default=256)
    bench.add_argument("--min-input-len", type=int, default=100)
    bench.add_argument("--max-input-len", type=int, default=1024)
    bench.add_argument("--min-output-len", type=int, default=100)
    bench.add_argument("--max-output-len", type=int, default=1024)
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.add_argument("--serving", action="store_true", help="run the serving load against --url instead")
    from nanovllm.entrypoints.serve_bench import add_serve_bench_args

    add_serve_bench_args(bench)
    add_engine_args(bench)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and not argv[0].startswith("-") else None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        if hasattr(args, "tensor_parallel_size") and _torchrun_launch(args):
            return run_torchrun_rank(args)
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"nanovllm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for it, without a traceback
        print("nanovllm: interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The program's entry point: main(), then, once the output is flushed, exit without tearing
    the interpreter down (freeing torch's and the model's objects one by one is slow and does
    nothing a finished command needs). An exception still ends the process the usual way."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    run()
