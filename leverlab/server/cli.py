"""`leverlab serve [MODEL]`: the OpenAI-compatible server, with vLLM's flag names for every lever.

Lever flags map one to one onto EngineConfig fields; a lever not built yet is refused at start (exit 2)
with the config's message, never ignored. SIGTERM/SIGINT drain: new requests get 503, running ones get up to
--drain-timeout seconds to finish, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import sys
import time
from typing import Any

import uvicorn

from leverlab.server.tool_parsers import PARSERS

log = logging.getLogger("leverlab.server")

FLUSH_TIMEOUT_S = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="Hugging Face model folder, or a Hub id found in (or fetched into) the Hugging Face cache, e.g. "
        "Qwen/Qwen3-0.6B, or a GGUF file (default: the bundled default model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model'; the first is reported (default: the model folder's name)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on /v1 (default: $LEVERLAB_API_KEY, else open)",
    )
    from leverlab.engine_args import add_engine_arguments

    add_engine_arguments(p)
    g = p.add_argument_group("serving (named as in vLLM)")
    g.add_argument("--chat-template", default=None,
                   help="the server's chat template: a file, or the template text (default: the tokenizer's)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render chat templates that requests bring (chat_template): off by default, since a "
                   "template can loop and allocate without bound")
    g.add_argument("--generation-config", default="auto",
                   help="sampling defaults: 'auto' (the model's generation_config.json), 'vllm' (none) or a folder")
    g.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="chat answers' <think>...</think> text goes to message.reasoning_content (and "
                        "reasoning), the rest to content, streamed too; as vLLM's parsers of the same names")
    g.add_argument("--max-logprobs", type=int, default=20, help="the most top logprobs a request may ask for")
    g.add_argument("--disable-log-requests", action="store_true", help="no log line per request")
    g.add_argument("--allowed-origins", nargs="+", default=None,
                   help="web page origins allowed to call the API (CORS), e.g. http://localhost:3000 or '*'; "
                   "default none: requests that carry an Origin header are refused")
    g.add_argument("--stream-stall-timeout", type=float, default=60.0,
                   help="seconds a stream may wait on a client that reads nothing before it is aborted")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto': the model decides, --tool-call-parser finds its calls")
    g.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="the model's tool-call format (hermes: Qwen2.5/Qwen3, Hermes)")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish after SIGTERM",
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
    )


def engine_config(args: argparse.Namespace):
    """The EngineConfig of these flags, with a Hub id resolved to its cached folder (ModelNotFound if not)."""
    from leverlab.config import default_model_path
    from leverlab.engine_args import config_from_args

    return config_from_args(args, str(args.model or default_model_path())).resolve_models()


def lever_summary(engine: Any) -> str:
    """The lever settings as one line of key=value, as the engine resolved them."""
    cfg = engine.config
    keys = (
        "dtype",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_waiting",
        "quantization",
        "kv_cache_dtype",
        "speculative_config",
        "tensor_parallel_size",
        "data_parallel_size",
        "enable_prefix_caching",
        "execution_mode",
        "device",
    )
    values = {k: getattr(cfg, k, None) for k in keys}
    # What the weights are as loaded: a pre-quantized checkpoint (AWQ, GPTQ, `leverlab quantize` output)
    # carries its method without --quantization.
    values["quantization"] = engine.quantization or values["quantization"]
    return f"max_model_len={engine.max_model_len} " + " ".join(f"{k}={v}" for k, v in values.items())


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from leverlab.errors import EngineDeadError, ModelNotFound, UnsupportedLever

    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        print("leverlab serve: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    try:
        cfg = engine_config(args)
    except ModelNotFound as e:  # no such folder, and a Hub id neither cached nor downloadable
        print(f"leverlab serve: {e}", file=sys.stderr)
        return 1
    except UnsupportedLever as e:
        print(f"leverlab serve: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        print(f"leverlab serve: invalid setting: {e}", file=sys.stderr)
        return 2
    try:
        if cfg.tensor_parallel_size > 1:
            from leverlab.distributed.rendezvous import resolve

            rdv = resolve(cfg)
            if rdv.node_rank != 0:  # another host of a multi-host job: its ranks only, no API
                from leverlab.engine.llm_engine import serve_node

                return serve_node(cfg, rdv)
        return asyncio.run(_main(args, cfg))
    except (UnsupportedLever, ValueError) as e:  # a setting the engine refuses once it sees the model
        print(f"leverlab serve: {e}", file=sys.stderr)
        return 2
    except EngineDeadError as e:  # a data-parallel replica died while starting (its log says why)
        print(f"leverlab serve: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # no such model folder, unreadable weights
        print(f"leverlab serve: cannot load the model {cfg.model!r}: {e}", file=sys.stderr)
        return 1


async def _main(args: argparse.Namespace, cfg: Any) -> int:
    from leverlab.engine.async_engine import AsyncLLM
    from leverlab.server.app import build_app

    # The event loop shares the GIL with the engine thread and the server's worker threads (parsing, building
    # big responses). With Python's default 5 ms switch interval, each of the dozen GIL hand-offs that a
    # request takes on the loop can wait 5 ms per busy thread: /health measured 90-160 ms while a
    # prompt_logprobs response was built. 1 ms keeps the loop's share frequent; the cost is a little more
    # switching in CPU-bound Python, and none while threads run torch ops or sleep (they drop the GIL).
    sys.setswitchinterval(0.001)
    # Built inside the running loop: the engine may bind its asyncio side to it.
    if cfg.data_parallel_size > 1:
        from leverlab.engine.replicas import ReplicaSet

        engine = ReplicaSet(cfg)
    else:
        engine = AsyncLLM(cfg)
    app = build_app(engine, args)
    # Everything loaded so far (torch, transformers, the model) lives as long as the process: take it out of
    # the cyclic GC's sight. A full collection otherwise walks all of it while holding the GIL, which
    # showed up as 100+ ms stalls of the event loop while big logprobs responses were being built.
    gc.collect()
    gc.freeze()
    from leverlab.server.protocol import CompletionRequest

    app.state.server.parser.start(CompletionRequest, app.state.server.limits)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=args.uvicorn_log_level in ("info", "debug", "trace"),
        lifespan="off",
        # uvicorn's own wait starts after the engine has drained: responses left by then only need flushing.
        timeout_graceful_shutdown=FLUSH_TIMEOUT_S,
    )
    server = DrainingServer(config, app, engine, args.drain_timeout)
    watch = asyncio.get_running_loop().create_task(server.watch_engine())
    names = app.state.server.served_names
    log.info(
        "LeverLab serving %s at http://%s:%d/v1 (%s)",
        names[0],
        args.host,
        args.port,
        lever_summary(engine),
    )
    try:
        await server.serve()
    finally:
        watch.cancel()
        app.state.server.parser.close()
        if not server.drained:
            with contextlib.suppress(Exception):
                await engine.shutdown(0)
    if server.engine_failed:
        return 1
    return 0 if server.started else 1


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM/SIGINT first drains the engine, then stops uvicorn (exit status 0).

    uvicorn's own handler would stop at once and re-raise the signal after shutdown (exit 143); here the
    first signal marks the app as draining (new requests: 503), awaits engine.shutdown(drain_timeout), and
    only then tells uvicorn to exit, which waits for the responses in flight to be written. A second SIGINT
    forces the exit.
    """

    def __init__(self, config: uvicorn.Config, app: Any, engine: Any, drain_timeout: float):
        super().__init__(config)
        self.app, self.engine, self.drain_timeout = app, engine, drain_timeout
        self.drained = False
        self.engine_failed = False
        self._drain_task: asyncio.Task | None = None

    async def watch_engine(self) -> None:
        """An engine that dies (the step loop raised, a tensor-parallel rank died) cannot recover: fail what is
        in flight (the engine already pushed the error into every open stream), stop serving, and exit non-zero
        so that a supervisor restarts the process, instead of answering 503 for ever."""
        while not self.should_exit:
            await asyncio.sleep(0.2)
            if self._drain_task is None and not self.engine.healthy:  # (a drain stops the engine on purpose)
                break
        else:
            return
        log.error("the engine failed; leaving with exit status 1 so that a supervisor restarts the server")
        self.engine_failed = True
        state = self.app.state.server
        state.draining = True  # new requests: 503
        await asyncio.sleep(0.5)  # let the streams send their error event and [DONE]
        state.stopped.set()  # anything still waiting ends now
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        state = self.app.state.server
        if state.draining:
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        log.info("signal %d: draining (new requests get 503; running ones get %g s)", sig, self.drain_timeout)
        state.draining = True
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        t0 = time.monotonic()
        try:
            await self.engine.shutdown(self.drain_timeout)
            self.drained = True
            log.info("engine drained in %.1f s", time.monotonic() - t0)
        except Exception:
            log.exception("engine shutdown failed")
        # Requests still open now were cut off by the drain timeout: end them cleanly (503 or an 'abort'
        # chunk plus [DONE]) instead of leaving them to uvicorn's cancellation.
        self.app.state.server.stopped.set()
        self.should_exit = True
