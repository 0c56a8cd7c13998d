"""Peer benchmark: LeverLab against llama.cpp and vLLM on the same weights, in one run.

Each peer (--peers llamacpp,vllm; default llamacpp) is measured against ours at each precision (bf16, int8, int4),
one engine at a time, in interleaved rounds with the same thread count; the best round of each counts (the least
disturbed on a shared machine). A peer is one class below (`LlamaCpp`, `Vllm`): how it gets its weights, what it
can measure, its server command and its thread binding.

  llama.cpp  the checkpoint converted to GGUF by llama.cpp's own converter (bf16; Q8_0 and Q4_0 by llama-quantize),
             measured by its own bench tools (built once into the cache: leverlab/bench/peer_llamacpp.py)
  vLLM       its CPU build in a venv of its own (leverlab/bench/peer_vllm.py), reading the bf16 folder itself, int8
             as a compressed-tensors W8A8 folder and int4 as an AWQ folder, both written once into the cache by our
             `leverlab quantize --method w8a8 / int4`; measured in-process by scripts/vllm_inprocess.py, one worker
             per precision kept alive across the rounds (vLLM.LLM.generate on token ids)

  decode     single-stream decode after a 128-token prompt, 64 tokens: llama-bench -d 128 -n 64 / vLLM's and our
             LLM.generate (tokens after the first over first -> last token time)
  prefill    a cold 128-token prompt (--prefill-len): llama-bench -p 128 / prompt tokens over the time to the first
             token of a one-token generate (prefix caching off in ours and vLLM)
  decode@16  16 sequences together: llama-batched-bench -npp 128 -ntg 64 -npl 16 / LLM.generate of 16 prompts
             (aggregate decode tok/s)
  servers    `leverlab serve`, `llama-server -np 16 -cb` and vLLM's OpenAI server, each alone, driven by `leverlab
             bench`: median per-request decode tok/s at concurrency 1 and output tok/s at 16 on the decode bucket,
             and the median TTFT of the prompt set's 512- and 1,500-token buckets (medium, long) at concurrency 1
             (prefix caching off in ours and vLLM, so every prompt is cold)

llama.cpp's bench tools feed random tokens and never sample; the in-process figures of ours and vLLM include
sampling and detokenization, the servers' figures include everything on every side. Each of our precisions runs
in a process of its own (see `Ours`), as each of vLLM's does. Read the ratios ("LeverLab / peer": > 1 means ours
is faster, for TTFT too), measured in this run; the machine is shared and the absolute figures drift. The table
also gives each decode rate's share of its engine's bandwidth roofline at the better of the start's and the end's
read bandwidth, and a second list the share at the bandwidth measured just before each precision's block in the
same round (where the machine's bandwidth moves within a run). A step's bytes are its weights (ours in its loaded
layout, llama.cpp's GGUF tensors, vLLM's folder's tensors) and the KV cache its attention reads at the decode span's
mean context (--prompt-len + --decode-len / 2; 16-bit in every engine), so the roofline stays honest at long
contexts, where the cache can outweigh an int4 model's weights; the weights-only shares are kept in the JSON. Our
precisions are also compared generation by generation (--pair-reps: each rep decodes once in every precision,
seconds apart), since the rounds' blocks fall minutes apart, in different spells of the machine's bandwidth. Each
block also records the share of CPU time the host gave to other guests during it (/proc/stat's steal;
study/steal.py) and, before it, how much faster the threads ran a compute-bound product than one thread (near 1:
they shared a core). Raw figures and settings go to results/bench_peer-<time>.json.

Threads: ours --threads; llama.cpp -t --threads; vLLM --threads compute threads bound to cores 0.. and, on a
machine with a core to spare, one core reserved for its front end (VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_NUM_OF_RESERVED_CPU: on 2 cores with --threads 1, vLLM's own default). The binding is printed.

    python scripts/bench_peer.py [--peers llamacpp,vllm] [--model DIR] [--precisions bf16,int8,int4] [--rounds 3]
                                 [--threads 1] [--measurements decode,prefill,decode16] [--prompt-len 128]
                                 [--no-servers] [--pair-reps 8] [--llamacpp-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_decode import aggregate_decode  # noqa: E402
from bench_quant import expert_counts, hit_experts_per_layer, step_weight_bytes  # noqa: E402
from server_proc import free_port, stop, wait_ready  # noqa: E402

from leverlab.bench import peer_llamacpp, peer_vllm  # noqa: E402
from leverlab.study.bandwidth import measure_bandwidth, thread_scaling  # noqa: E402
from leverlab.study.steal import StealMeter  # noqa: E402


@dataclass(frozen=True)
class Measure:
    label: str  # "{batch}" is filled in with --batch
    roof: int | str | None  # tokens one step yields, for the roofline ("batch": --batch); None: no roofline
    unit: str = "tok/s"
    lower_better: bool = False  # TTFT: the best round is the least, and the ratio is peer over ours


# The keys say 16, the default --batch; the labels say the batch used.
MEASUREMENTS = {
    "decode": Measure("decode, 1 sequence", 1),
    "prefill": Measure("prefill", None),
    "decode16": Measure("decode, {batch} sequences", "batch"),
    "server_c1": Measure("server decode, c=1", 1),
    "server_c16": Measure("server output, c={batch}", None),
    "server_ttft512": Measure("server TTFT, 512 tokens", None, "ms", True),
    "server_ttft1500": Measure("server TTFT, 1,500 tokens", None, "ms", True),
}
IN_PROCESS = tuple(k for k in MEASUREMENTS if not k.startswith("server"))  # measured without the servers
TTFT_BUCKETS = {"server_ttft512": "medium", "server_ttft1500": "long"}  # the bundled prompt set's 512 / 1,500
OURS = "leverlab"
LABELS = {OURS: "LeverLab", "llamacpp": "llama.cpp", "vllm": "vLLM"}
PRECISIONS = tuple(peer_llamacpp.GGUF_TYPES)  # bf16, int8, int4: what every engine here runs


def engines(args) -> list[str]:
    """Ours first, then the peers in --peers order: the table's columns and a round's order."""
    return [OURS, *args.peers]


def tail_text(text: str, lines: int = 15) -> str:
    return "\n".join(("    " + ln) for ln in (text or "").strip().splitlines()[-lines:])


def run_peer_tool(cmd: list, timeout: float = 900) -> str | None:
    """stdout of a llama.cpp tool, or None after printing why it failed (the run goes on without it)."""
    try:
        p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"    {Path(str(cmd[0])).name} failed: {e}", flush=True)
        return None
    if p.returncode != 0:
        print(f"    {Path(str(cmd[0])).name} exited {p.returncode}; stderr tail:\n{tail_text(p.stderr)}", flush=True)
        return None
    return p.stdout


class OursEngine:
    """Our engine at one precision: loaded and warmed once (inside an `Ours` worker process)."""

    def __init__(self, model: str, precision: str, args):
        from leverlab import LLM, SamplingParams

        t0 = time.perf_counter()
        mode = {"execution_mode": args.execution_mode} if args.execution_mode else {}  # else the engine's default
        self.llm = LLM(model, dtype="bfloat16", quantization=None if precision == "bf16" else precision,
                       num_threads=args.threads, **mode, max_num_seqs=args.batch,
                       max_num_batched_tokens=max(512, args.prefill_len, args.prompt_len),
                       max_model_len=max_model_len(args),
                       enable_prefix_caching=False)
        self.params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        rows = args.batch if "decode16" in args.measurements else 1  # a long prompt x 16 is a long warm-up
        self.llm.generate([[7] * args.prompt_len] * rows, self.params(4))  # compile / warm every shape
        self.llm.generate([[7] * args.prefill_len], self.params(4))
        self.setup_s = time.perf_counter() - t0
        self.mode = self.llm.engine.config.execution_mode
        model = self.llm.engine.runner.model
        experts = self.llm.engine.model_config.num_experts  # a mixture of experts: every expert, then routed_bytes
        self.weight_bytes = step_weight_bytes(model, 1, hit_experts=experts or None)
        self.routed_bytes = routed_expert_bytes(model)
        self.prefetch = stream_prefetch_modes(model)

    def measure(self, key: str, prompts: list[list[int]], decode_len: int) -> tuple[float, float | None]:
        """(tok/s, the routed experts per sparse layer its decode passes read, as the engine counted them; None for
        a dense model). tok/s: prefill = prompt tokens / TTFT; decode = tokens after each sequence's first over the
        span after every sequence had its first (prefill stays out)."""
        if key == "prefill":
            (out,) = self.llm.generate(prompts, self.params(1))
            return len(prompts[0]) / out.metrics.ttft, None
        runner = self.llm.engine.runner
        before = expert_counts(runner)
        tok_s = aggregate_decode(self.llm.generate(prompts, self.params(decode_len)))[0]
        return tok_s, hit_experts_per_layer(runner, before)


def routed_expert_bytes(model) -> int:
    """Bytes of all a mixture of experts' routed experts in their loaded layout (0 for a dense model)."""
    from leverlab.models.expert_reads import expert_bytes
    from leverlab.models.moe import SparseMoE

    return sum(expert_bytes(m) * len(m.experts) for m in model.modules() if isinstance(m, SparseMoE))


def stream_prefetch_modes(model) -> dict[str, str]:
    """The weight-prefetch mode each kernel family of this model streams in (measured at load, in whatever spell
    the machine's bandwidth was in then; layers/prefetch_tune.py): part of what a run's decode rates ran under."""
    from leverlab.kernels import cpu_kernels
    from leverlab.layers import prefetch_tune
    from leverlab.layers.linear import Linear

    kern = cpu_kernels.kernels()
    if kern is None:
        return {}
    families = {prefetch_tune.family(m) for m in model.modules() if isinstance(m, Linear)} - {None}
    return {f: kern.stream_prefetch(f) for f in sorted(families)}


def _ours_worker(conn, model: str, precision: str, cfg: dict) -> None:
    try:
        eng = OursEngine(model, precision, argparse.Namespace(**cfg))
        conn.send({"setup_s": eng.setup_s, "weight_bytes": eng.weight_bytes, "mode": eng.mode,
                   "prefetch": eng.prefetch, "routed_bytes": eng.routed_bytes})
        while (msg := conn.recv()) is not None:
            tok_s, hit = eng.measure(*msg, cfg["decode_len"])
            conn.send({"tok_s": tok_s, "hit": hit})
    except Exception as e:  # reported to the parent, which goes on without this precision
        conn.send({"error": f"{type(e).__name__}: {e}"})


class Ours:
    """OursEngine in a process of its own, idle while the peer runs. Its own process because (compiled mode)
    torch.compile's caches belong to the process and are keyed on the code, not the model: three models compiled in one process
    share one recompile budget (8 per function), and the later ones fall back to eager (seen: int4 "warmed" in
    3 s, slower than int8)."""

    def __init__(self, model: str, precision: str, args):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # fork after torch has started threads is unsafe
        self.conn, child = ctx.Pipe()
        cfg = {k: getattr(args, k) for k in ("threads", "execution_mode", "batch", "prefill_len", "prompt_len",
                                              "decode_len", "measurements")}
        self.proc = ctx.Process(target=_ours_worker, args=(child, model, precision, cfg), daemon=True)
        self.proc.start()
        child.close()
        reply = self._recv()
        self.setup_s, self.weight_bytes, self.mode = reply["setup_s"], reply["weight_bytes"], reply["mode"]
        self.prefetch, self.routed_bytes = reply["prefetch"], reply["routed_bytes"]
        self.hits: dict[str, float] = {}  # measurement -> routed experts per sparse layer per decode pass (MoE)

    def _recv(self) -> dict:
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"the LeverLab worker died (exit {self.proc.exitcode})") from None
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return msg

    def measure(self, key: str, prompts: list[list[int]]) -> float:
        self.conn.send((key, prompts))
        reply = self._recv()
        if reply["hit"] is not None:
            self.hits[key] = reply["hit"]
        return reply["tok_s"]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()  # by its pid: the worker we started
            self.proc.join()


class PeerUnavailable(RuntimeError):
    """The peer cannot run here at all (not built, not installed): the message says why and how to fix it."""


class Peer:
    """What the benchmark needs of a peer engine. `prepare` once (build, convert, export; may raise
    PeerUnavailable), `start` before the rounds (whatever stays loaded), `measure` an in-process measurement,
    `server` its OpenAI server's command, `close` at the end."""

    name = ""
    in_process: tuple[str, ...] = IN_PROCESS  # the in-process measurements it can make

    @property
    def label(self) -> str:
        return LABELS[self.name]

    def prepare(self, args) -> dict:
        """Settings for the JSON."""
        return {}

    def start(self, args, work: Path) -> None:
        pass

    def format_of(self, prec: str) -> str:
        """The peer's name for the weights it runs at this precision."""
        raise NotImplementedError

    def weight_bytes(self, prec: str) -> int | None:
        """Bytes of weights one decode step reads (the roofline's numerator with the KV cache); of a mixture of
        experts, every expert's (step_weights takes out those a step does not read)."""
        raise NotImplementedError

    def routed_bytes(self, prec: str) -> int | None:
        """Of a mixture of experts, the bytes of all its routed experts in this peer's weights (None: unknown)."""
        return None

    def binding(self, args) -> str:
        """How its threads are set and bound, as printed and kept in the JSON."""
        raise NotImplementedError

    def measure(self, key: str, prec: str, prompts: list[list[int]], args) -> tuple[float | None, dict | None]:
        """(tok/s or None where it failed, a raw record for the JSON or None)."""
        raise NotImplementedError

    def server(self, prec: str, port: int, args) -> tuple[list, dict | None]:
        """(its server's command on 127.0.0.1:port, its environment or None for ours)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class LlamaCpp(Peer):
    """llama.cpp: its own bench tools on GGUFs converted from the checkpoint, and llama-server."""

    name = "llamacpp"

    def prepare(self, args) -> dict:
        self.root = Path(args.llamacpp_dir).expanduser() if args.llamacpp_dir else peer_llamacpp.default_dir()
        try:
            self.bins = peer_llamacpp.ensure_built(self.root, args.jobs)
            self.ggufs = peer_llamacpp.convert(Path(args.model), self.root, self.bins, args.precisions,
                                               args.pre_tokenizer)
        except peer_llamacpp.PeerError as e:
            raise PeerUnavailable(str(e)) from e
        return {"llamacpp_dir": str(self.root), "llama_cpp_python": peer_llamacpp.VERSION,
                "gguf": {p: str(g) for p, g in self.ggufs.items()}}

    def format_of(self, prec: str) -> str:
        return peer_llamacpp.GGUF_TYPES[prec]

    def weight_bytes(self, prec: str) -> int | None:
        return peer_llamacpp.gguf_weight_bytes(self.ggufs[prec], self.root)

    def routed_bytes(self, prec: str) -> int | None:
        return peer_llamacpp.gguf_weight_bytes(self.ggufs[prec], self.root, experts_only=True)

    def binding(self, args) -> str:
        return f"-t {args.threads} (its threads unpinned)"

    def measure(self, key, prec, prompts, args):
        """llama-bench for one sequence, llama-batched-bench for many; they draw their own random tokens, so the
        prompts are not used, only their lengths (--prompt-len, --prefill-len)."""
        gguf = self.ggufs[prec]
        if key == "decode":  # -d: the context filled first (untimed), -p 0: no separate prompt test
            r = self._bench(gguf, args.threads, ["-p", 0, "-n", args.decode_len, "-d", args.prompt_len])
        elif key == "prefill":
            r = self._bench(gguf, args.threads, ["-p", args.prefill_len, "-n", 0])
        else:
            r = self._batched(gguf, args.threads, args.prompt_len, args.decode_len, args.batch)
        return (r and r["speed_tg" if key == "decode16" else "avg_ts"]), r

    def _bench(self, gguf: Path, threads: int, extra: list) -> dict | None:
        out = run_peer_tool([self.bins["llama-bench"], "-m", gguf, "-t", threads, "-r", 1, "-o", "json", *extra])
        if out is None:
            return None
        try:
            return json.loads(out)[0]
        except (ValueError, IndexError) as e:
            print(f"    llama-bench printed no JSON result ({e}):\n{tail_text(out)}", flush=True)
            return None

    def _batched(self, gguf: Path, threads: int, pp: int, tg: int, npl: int) -> dict | None:
        out = run_peer_tool([self.bins["llama-batched-bench"], "-m", gguf, "-t", threads, "-npp", pp, "-ntg", tg,
                             "-npl", npl, "-c", npl * (pp + tg), "--output-format", "jsonl"])
        if out is None:
            return None
        rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
        if not rows:
            print(f"    llama-batched-bench printed no JSON line:\n{tail_text(out)}", flush=True)
            return None
        return rows[-1]

    def server(self, prec, port, args):
        # One slot per client in flight; -c is the whole KV pool, split evenly between the slots: each holds the
        # decode bucket's prompt and output, or the longest TTFT prompt (1,500 tokens) and its few tokens.
        slot = max(args.server_output_len + 512, 1600 + args.ttft_output_len)
        return [self.bins["llama-server"], "-m", self.ggufs[prec], "-t", args.threads, "-np", args.batch, "-cb",
                "-c", args.batch * slot, "--host", "127.0.0.1", "--port", port, "--metrics"], None


VLLM_FORMATS = {"bf16": "bf16", "int8": "W8A8 int8 (compressed-tensors)", "int4": "AWQ int4, group 64"}


def safetensors_bytes(folder: Path, experts_only: bool = False) -> int:
    """The tensor bytes of a folder's safetensors files, read from their headers (8-byte length, then JSON);
    experts_only: a mixture of experts' routed experts only (Hugging Face's `.experts.N.` tensors)."""
    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items()
                     if k != "__metadata__" and (not experts_only or ".experts." in k))
    return total


def max_model_len(args) -> int:
    """The longest sequence the in-process measurements make (ours and vLLM's engines are sized by it)."""
    return max(args.prompt_len, args.prefill_len) + args.decode_len + 16


class VllmWorker:
    """scripts/vllm_inprocess.py under vLLM's python: one model loaded once, measured over JSON lines (its
    docstring has the protocol); its log (vLLM's own output) goes to `log`."""

    def __init__(self, cmd: list, env: dict | None, log: Path, start_timeout: float = 900,
                 measure_timeout: float = 1800):
        self.log, self.measure_timeout = log, measure_timeout
        # A session of its own: vLLM's engine and model-runner processes are its children, and a worker stopped
        # while it loads (a failed start, our SIGTERM) must not leave them behind; close() ends the group.
        with open(log, "wb") as f:
            self.proc = subprocess.Popen([str(c) for c in cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=f, env=env, text=True, cwd=ROOT, start_new_session=True)
        try:
            self.ready = self._recv(start_timeout)["ready"]
        except BaseException:
            self.close()
            raise

    def _recv(self, timeout: float) -> dict:
        # A worker that hangs (a stuck load, a deadlocked engine) must not hang the run: wait for its line at most
        # `timeout`. select on the pipe is sound here: one reply is in flight at a time, so nothing is left
        # buffered on our side between replies.
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise RuntimeError(f"the vLLM worker gave no answer in {timeout:.0f} s (log: {self.log})")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            raise RuntimeError(f"the vLLM worker exited ({self.proc.returncode}); log tail ({self.log}):\n"
                               f"{tail_text(self.log.read_text(errors='replace'))}")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(msg["error"])
        return msg

    def measure(self, key: str, prompts: list[list[int]], decode_len: int) -> dict:
        self.proc.stdin.write(json.dumps({"measure": key, "prompts": prompts, "decode_len": decode_len}) + "\n")
        self.proc.stdin.flush()
        return self._recv(self.measure_timeout)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(60 if self.proc.poll() is None and getattr(self, "ready", None) else 1)
        except subprocess.TimeoutExpired:
            pass
        # The worker's own session (its pid is its group's id): vLLM's processes under it, which vLLM ends itself
        # on a clean exit; SIGTERM first (the worker then shuts vLLM down), SIGKILL what is left.
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait_s)
                time.sleep(1)  # its children exit after it


class Vllm(Peer):
    """vLLM's CPU build: in-process through scripts/vllm_inprocess.py workers, and its OpenAI server."""

    name = "vllm"

    def __init__(self):
        self.workers: dict[str, VllmWorker | None] = {}
        self.folders: dict[str, Path] = {}

    def prepare(self, args) -> dict:
        self.python = peer_vllm.python()
        if self.python is None:
            raise PeerUnavailable(peer_vllm.missing())
        for p in args.precisions:
            try:
                self.folders[p] = peer_vllm.quantized_folder(Path(args.model), p)
            except (OSError, ValueError) as e:
                raise PeerUnavailable(f"could not write the {peer_vllm.EXPORTS[p]} folder vLLM reads: {e}") from e
        return {"vllm_python": str(self.python), "vllm_version": peer_vllm.VERSION,
                "folders": {p: str(f) for p, f in self.folders.items()}, "env": self.bind_env(args)}

    def bind_env(self, args) -> dict:
        return {k: v for k, v in peer_vllm.server_env(args.threads, base={}).items() if k.startswith("VLLM_")}

    def env(self, args) -> dict:
        return peer_vllm.server_env(args.threads)

    def worker_env(self, args) -> dict:
        """The server's binding, with the KV space given to the worker in bytes (--kv-cache-bytes) rather than
        VLLM_CPU_KVCACHE_SPACE's whole GiB: three workers of 2 GiB each (the server's default) are 6 GiB a shared
        machine may not have, for a benchmark whose sequences need a few MB (the 0.6B shape: some 300 MB)."""
        e = self.env(args)
        e.pop("VLLM_CPU_KVCACHE_SPACE", None)
        return e

    @staticmethod
    def kv_bytes(args) -> int:
        """KV cache for the in-process measurements: 16 sequences of prompt + decode, or one max-length one (vLLM
        refuses a pool that cannot hold one), half again for its block rounding, at least 64 MiB."""
        tokens = max(args.batch * (args.prompt_len + args.decode_len + 16), max_model_len(args))
        return max(64 << 20, int(1.5 * tokens * args.kv_bytes_per_token))

    def worker_command(self, prec: str, args) -> list:
        return [self.python, ROOT / "scripts" / "vllm_inprocess.py", "--model", self.folders[prec],
                "--max-model-len", max_model_len(args), "--kv-cache-bytes", self.kv_bytes(args),
                "--max-num-seqs", args.batch,
                "--max-num-batched-tokens", max(512, args.prefill_len, args.prompt_len),  # as ours
                "--warm-prompt-len", args.prompt_len, "--prefill-len", args.prefill_len,
                "--warm-rows", args.batch if "decode16" in args.measurements else 1]

    def start(self, args, work: Path) -> None:
        work.mkdir(parents=True, exist_ok=True)
        for p in args.precisions:
            t0 = time.perf_counter()
            try:
                self.workers[p] = VllmWorker(self.worker_command(p, args), self.worker_env(args),
                                             work / f"vllm-{p}.log", args.server_start_timeout)
                r = self.workers[p].ready
                print(f"vLLM {p} ({self.format_of(p)}): loaded and warmed in {time.perf_counter() - t0:.0f} s "
                      f"(own process; per-request engine timestamps: {r['engine_timestamps']})", flush=True)
            except (RuntimeError, OSError) as e:
                self.workers[p] = None
                print(f"vLLM {p}: failed to start ({e}); its in-process figures are missing", flush=True)

    def format_of(self, prec: str) -> str:
        return VLLM_FORMATS[prec]

    def weight_bytes(self, prec: str) -> int | None:
        return safetensors_bytes(self.folders[prec]) if prec in self.folders else None

    def routed_bytes(self, prec: str) -> int | None:
        return safetensors_bytes(self.folders[prec], experts_only=True) if prec in self.folders else None

    def binding(self, args) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.bind_env(args).items() if k != "VLLM_CPU_KVCACHE_SPACE")

    def measure(self, key, prec, prompts, args):
        w = self.workers.get(prec)
        if w is None:
            return None, None
        try:
            r = w.measure(key, prompts, args.decode_len)
        except RuntimeError as e:
            print(f"    vLLM {prec} {key}: {e}", flush=True)
            if w.proc.poll() is not None or "no answer" in str(e):  # dead or stuck: its figures are missing now
                w.close()
                self.workers[prec] = None
            return None, None
        return r["tok_s"], {"timing": r.get("timing")}

    def server(self, prec, port, args):
        cmd = peer_vllm.server_command(str(self.folders[prec]), port, "--dtype", "bfloat16", "--max-num-seqs",
                                       str(args.batch), "--no-enable-prefix-caching")
        return cmd, self.env(args)

    def close(self) -> None:
        for w in self.workers.values():
            if w is not None:
                w.close()


PEERS = {"llamacpp": LlamaCpp, "vllm": Vllm}


def bench_server(port: int, out: Path, flags: list) -> tuple[dict | None, str]:
    """`leverlab bench` against 127.0.0.1:port with these flags: ({group name: group} of its summary, or None,
    and what it printed when it failed)."""
    cmd = [sys.executable, "-m", "leverlab.cli", "bench", "--base-url", f"http://127.0.0.1:{port}/v1", *flags,
           "--out", out, "--quiet"]
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=ROOT)
    summary = out / "summary.json"
    if p.returncode not in (0, 1) or not summary.exists():  # 1: some requests failed, figures still written
        return None, f"exited {p.returncode}:\n{tail_text(p.stderr or p.stdout)}"
    return {g["name"]: g for g in json.loads(summary.read_text())["groups"]}, ""


def serve_and_bench(name: str, cmd: list, port: int, out_dir: Path, args, env: dict | None = None) -> dict | None:
    """Start one server alone, drive it with `leverlab bench`, always stop it: c=1 and c=16 on the decode bucket,
    then (the server warm) the TTFT buckets one request at a time, with no warm-up of their own, so that no
    measured prompt was seen before (each server's prefix cache is off too, where it has one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "server.log"
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        if not wait_ready(proc, port, args.server_start_timeout):
            print(f"    {name} did not come up (exit {proc.poll()}); log tail ({log}):\n"
                  f"{tail_text(log.read_text(errors='replace'))}", flush=True)
            return None
        start_s = time.perf_counter() - t0
        groups, why = bench_server(port, out_dir / "bench", [
            "--buckets", args.server_bucket, "--output-len", args.server_output_len, "--num-prompts",
            args.server_prompts, "--skip-single", "--concurrency", f"1,{args.batch}", "--sweep-rounds", 1,
            "--warmup", 2])
        if groups is None:
            print(f"    leverlab bench against {name} {why}", flush=True)
            return None
        c1, cn = groups[f"sweep/{args.server_bucket}/c1"], groups[f"sweep/{args.server_bucket}/c{args.batch}"]
        res = {"server_c1": c1["decode_tok_s"]["p50"], "server_c16": cn["output_throughput"], "start_s": start_s,
               "errors": c1["errors"] + cn["errors"],
               "output_len_mismatches": c1["output_len_mismatches"] + cn["output_len_mismatches"],
               "input_tokens_mean": c1["input_tokens"]["mean"], "tpot_ms_p50_c1": c1["tpot_ms"]["p50"],
               "cached_prompt_fraction_c16": cn["cached_prompt_fraction"], "bench_dir": str(out_dir / "bench")}
        if args.ttft_prompts > 0:
            ttft, why = bench_server(port, out_dir / "ttft", [
                "--buckets", ",".join(TTFT_BUCKETS.values()), "--output-len", args.ttft_output_len,
                "--num-prompts", args.ttft_prompts, "--concurrency", "", "--warmup", 0])
            if ttft is None:
                print(f"    leverlab bench (TTFT) against {name} {why}", flush=True)
            for key, bucket in TTFT_BUCKETS.items():
                g = (ttft or {}).get(f"single/{bucket}")
                if g and g["ttft_ms"].get("p50"):
                    res[key] = g["ttft_ms"]["p50"]
                    res[f"{key}_input_tokens_mean"] = g["input_tokens"]["mean"]
                    res["errors"] += g["errors"]
        if res["errors"] or res["output_len_mismatches"]:
            print(f"    {name}: {res['errors']} failed requests, {res['output_len_mismatches']} with another "
                  f"output length (see {out_dir})", flush=True)
        return res
    finally:
        stop(proc)


def ours_server_command(prec: str, port: int, args) -> list:
    cmd = [sys.executable, "-m", "leverlab.cli", "serve", args.model, "--port", port, "--dtype", "bfloat16",
           "--num-threads", args.threads, "--max-num-seqs", args.batch, "--drain-timeout", 5,
           "--no-enable-prefix-caching"]
    if args.execution_mode:
        cmd += ["--execution-mode", args.execution_mode]
    if prec != "bf16":
        cmd += ["--quantization", prec]
    return cmd


def keep_best(best: dict, prec: str, engine: str, key: str, value: float | None) -> None:
    """The best figure so far: the highest rate, the least TTFT."""
    if value is not None:
        slot = best.setdefault(prec, {}).setdefault(key, {})
        pick = min if MEASUREMENTS[key].lower_better else max
        slot[engine] = pick(value, slot[engine]) if engine in slot else value


def speed_ratio(key: str, ours: float | None, theirs: float | None) -> float | None:
    """How many times faster ours is: rate over rate, or (TTFT) their time over ours."""
    if not (ours and theirs):
        return None
    return theirs / ours if MEASUREMENTS[key].lower_better else ours / theirs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from leverlab.config import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="llamacpp", help=f"of {','.join(PEERS)}, in the table's order")
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--precisions", default="bf16,int8,int4", help=f"of {','.join(PRECISIONS)}")
    ap.add_argument("--measurements", default=",".join(IN_PROCESS),
                    help=f"of {','.join(IN_PROCESS)} (a long --prompt-len makes decode16's batched prefill slow)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each counts")
    ap.add_argument("--pair-reps", type=int, default=8,
                    help="our single streams, every precision decoding once per rep, seconds apart (0: none)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of every engine")
    ap.add_argument("--prompt-len", type=int, default=128, help="context before decode (llama-bench -d)")
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="sequences for decode@16 and the servers' c=16")
    ap.add_argument("--execution-mode", default=None, choices=("compiled", "eager"),
                    help="ours (default: the engine's default)")
    ap.add_argument("--servers", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--server-bucket", default="decode", help="bucket of the bundled prompt set")
    ap.add_argument("--server-output-len", type=int, default=256)
    ap.add_argument("--server-prompts", type=int, default=8, help="requests at c=1 (c=16 sends 16)")
    ap.add_argument("--ttft-prompts", type=int, default=5,
                    help="requests of each TTFT bucket (512 and 1,500 tokens), one at a time (0: no TTFT)")
    ap.add_argument("--ttft-output-len", type=int, default=8, help="tokens each TTFT request generates")
    ap.add_argument("--server-start-timeout", type=float, default=900)
    ap.add_argument("--llamacpp-dir", default=None, help="build + GGUF cache (default $LEVERLAB_CACHE/llamacpp/"
                                                         f"{peer_llamacpp.VERSION})")
    ap.add_argument("--jobs", type=int, default=None, help="llama.cpp build jobs (default: all cores)")
    ap.add_argument("--pre-tokenizer", default=None, help="llama.cpp pre-tokenizer for our tokenizer "
                                                          "(default: from tokenizer.json)")
    ap.add_argument("--out", default=None, help="JSON (default results/bench_peer-<UTC time>.json)")
    args = ap.parse_args(argv)
    args.peers = list(dict.fromkeys(p for p in args.peers.split(",") if p))
    bad = [p for p in args.peers if p not in PEERS]
    if bad or not args.peers:
        ap.error(f"unknown or no peer(s) {bad}; known: {list(PEERS)}")
    args.precisions = [p for p in args.precisions.split(",") if p]
    args.measurements = [m for m in args.measurements.split(",") if m]
    bad = [m for m in args.measurements if m not in IN_PROCESS]
    if bad or not args.measurements:
        ap.error(f"unknown or no measurement(s) {bad}; known: {list(IN_PROCESS)}")
    unknown = [p for p in args.precisions if p not in PRECISIONS]
    if unknown:
        ap.error(f"unknown precision(s) {unknown}; known: {list(PRECISIONS)}")
    args.model = str(Path(args.model).resolve())
    args.kv_bytes_per_token = kv_bytes_per_token(args.model)
    args.moe = moe_facts(args.model)
    return args


def bindings(peers: dict, args) -> dict[str, str]:
    """{engine: how its threads are set and bound}."""
    return {OURS: f"--threads {args.threads} (num_threads; torch's threads, unpinned)",
            **{name: pr.binding(args) for name, pr in peers.items()}}


def main() -> int:
    args = parse_args()
    # SIGTERM as an exception, so that the finally blocks stop the servers and workers this run started (a
    # background job has SIGINT ignored, so SIGTERM is how it gets stopped).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or ROOT / "results" / f"bench_peer-{stamp}.json")
    peers = {name: PEERS[name]() for name in args.peers}
    result: dict = {"settings": {**vars(args)}, "peers": {}, "rounds": []}
    for name, pr in peers.items():
        t_setup = time.perf_counter()
        try:
            result["peers"][name] = pr.prepare(args)
        except PeerUnavailable as e:
            print(f"bench_peer: {pr.label} is not available: {e}", file=sys.stderr)
            return 2
        result["peers"][name]["setup_s"] = time.perf_counter() - t_setup
    if "llamacpp" in result["peers"]:  # where earlier results had them
        result["settings"].update({k: v for k, v in result["peers"]["llamacpp"].items() if k != "setup_s"})
        result["llamacpp_setup_s"] = result["peers"]["llamacpp"]["setup_s"]
    result["binding"] = bindings(peers, args)
    bw = measure_bandwidth(args.threads)
    print(f"model {args.model}; {args.threads} thread(s); read bandwidth {bw:.1f} GB/s; "
          f"precisions {args.precisions}; peers {[LABELS[p] for p in args.peers]}; {args.rounds} round(s)", flush=True)
    print("thread binding: " + "; ".join(f"{LABELS[e]} {b}" for e, b in result["binding"].items()), flush=True)
    ours: dict[str, Ours | None] = {}
    try:
        for p in args.precisions:
            try:
                ours[p] = Ours(args.model, p, args)
                prefetch = ", ".join(f"{f} {m}" for f, m in ours[p].prefetch.items()) or "none"
                print(f"LeverLab {p}: {ours[p].mode} mode, loaded and warmed in {ours[p].setup_s:.0f} s "
                      f"(own process); weight prefetch: {prefetch}", flush=True)
                result.setdefault("leverlab_execution_mode", {})[p] = ours[p].mode
                result.setdefault("leverlab_stream_prefetch", {})[p] = ours[p].prefetch
            except RuntimeError as e:
                ours[p] = None
                print(f"LeverLab {p}: failed to start ({e}); its figures are missing", flush=True)
        for pr in peers.values():
            pr.start(args, out.with_suffix(""))
        weight_bytes = {p: {OURS: ours[p].weight_bytes if ours[p] else None,
                            **{name: pr.weight_bytes(p) for name, pr in peers.items()}} for p in args.precisions}
        if args.moe:
            args.moe["routed_bytes"] = {p: {OURS: ours[p].routed_bytes if ours[p] else None,
                                            **{name: pr.routed_bytes(p) for name, pr in peers.items()}}
                                        for p in args.precisions}
        best = run_rounds(args, ours, peers, result["rounds"], out.with_suffix(""))
        if args.moe:  # the experts our router chose in each decode measurement (the last round's)
            rows = {"decode": 1, "decode16": args.batch}
            args.moe["hits"] = {p: {rows[k]: h for k, h in ours[p].hits.items() if k in rows}
                                for p in args.precisions if ours.get(p)}
            result["moe"] = args.moe
        if "decode" in args.measurements:
            prompt = random_ids(torch.Generator().manual_seed(1), args.prompt_len, vocab_size(args.model))
            try:
                result["paired_precision_ratios"] = paired_precision_ratios(
                    lambda p: ours[p].measure("decode", [prompt]) if ours.get(p) else None, args)
            except RuntimeError as e:  # a worker died: the rounds' figures are still written
                print(f"the generation-by-generation comparison stopped: {e}", flush=True)
    finally:  # idle workers hold memory and threads; the end bandwidth figure wants neither
        for o in ours.values():
            if o is not None:
                o.close()
        for pr in peers.values():
            pr.close()
    # Bandwidth drifts on a shared machine: the better of start and end, so a share is never inflated by a
    # pessimistic measurement.
    bw_end = measure_bandwidth(args.threads)
    result.update(bandwidth_gb_s=bw, bandwidth_end_gb_s=bw_end, weight_bytes_per_step=weight_bytes, best=best)
    result["formats"] = {p: {name: pr.format_of(p) for name, pr in peers.items()} for p in args.precisions}
    result["roofline_shares"] = shares_both_ways(best, weight_bytes, max(bw, bw_end), args)
    result["speed_ratios"] = {p: {k: {e: speed_ratio(k, v.get(OURS), v.get(e)) for e in args.peers}
                                  for k, v in ms.items()} for p, ms in best.items()}
    print_table(best, weight_bytes, max(bw, bw_end), args, result["formats"], result["binding"])
    print_block_shares(result["rounds"], weight_bytes, args)
    if "decode" in args.measurements:
        result["precision_ratios"] = precision_ratios(result["rounds"], best, args)
        print_precision_ratios(result["precision_ratios"], args)
        print_paired_ratios(result.get("paired_precision_ratios"), args)
    print_notes(result["rounds"], weight_bytes, args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwritten to {out} (server logs, vLLM worker logs and `leverlab bench` folders in {out.with_suffix('')})")
    return 0


def random_ids(g: torch.Generator, n: int, vocab: int | None = None) -> list[int]:
    """n token ids in 100..999 drawn from g: the prompts of every measurement (the rounds and the paired block);
    below `vocab` where the model's vocabulary is smaller (a random checkpoint on the tests' tokenizer, such as
    scripts/bench_moe_decode.py writes: 384 ids)."""
    hi = 1000 if vocab is None else min(1000, vocab)
    return torch.randint(min(100, hi - 1), hi, (n,), generator=g).tolist()


def vocab_size(model: str) -> int | None:
    try:
        return json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    except (OSError, ValueError, KeyError):
        return None


def run_rounds(args, ours: dict, peers: dict, rounds: list, work: Path) -> dict:
    """Every measurement of every precision, one engine at a time, `args.rounds` times; every figure is appended
    to `rounds`, the best of each returned as {precision: {measurement: {engine: figure}}}."""
    g = torch.Generator().manual_seed(0)
    vocab = vocab_size(args.model)
    rand = lambda n: random_ids(g, n, vocab)  # noqa: E731
    best: dict = {}
    for rnd in range(1, args.rounds + 1):
        # Odd rounds run ours first, even rounds the peers first (in reverse): a drift within a round hits all alike.
        order = engines(args) if rnd % 2 else engines(args)[::-1]
        for p in args.precisions:
            prompts = {"decode": [rand(args.prompt_len)], "prefill": [rand(args.prefill_len)],
                       "decode16": [rand(args.prompt_len) for _ in range(args.batch)]}
            # The bandwidth beside each precision's block: on a shared machine it moved 50 <-> 78 GB/s within one
            # run, so a share of the start's figure alone says more about the neighbours than us.
            steal = StealMeter()  # and the CPU time the host gave to other guests during the block (study/steal.py)
            bw = measure_bandwidth(args.threads, gib=0.5, reps=3)
            rounds.append({"round": rnd, "precision": p, "measurement": "bandwidth", "gb_s": bw})
            print(f"  round {rnd} {p:5s} {'read bandwidth':22s} {'':9s} {bw:.1f} GB/s", flush=True)
            if (scale := thread_scaling(args.threads)) is not None:  # and whether the threads had cores of their own
                rounds.append({"round": rnd, "precision": p, "measurement": "thread_scaling", "x": scale})
                print(f"  round {rnd} {p:5s} {'compute, threads / one':22s} {'':9s} {scale:.2f}x", flush=True)
            for key in args.measurements:
                for eng in order:
                    raw = None
                    if eng == OURS:
                        v = ours[p].measure(key, prompts[key]) if ours[p] else None
                    elif key in peers[eng].in_process:
                        v, raw = peers[eng].measure(key, p, prompts[key], args)
                    else:
                        continue
                    rounds.append({"round": rnd, "precision": p, "engine": eng, "measurement": key, "tok_s": v,
                                   **({"raw": raw} if raw else {})})
                    keep_best(best, p, eng, key, v)
                    shown = f"{v:.1f} tok/s" if v is not None else "MISSING"
                    label = MEASUREMENTS[key].label.format(batch=args.batch)
                    print(f"  round {rnd} {p:5s} {label:22s} {eng:9s} {shown}", flush=True)
            if (share := steal.share()) is not None:
                rounds.append({"round": rnd, "precision": p, "measurement": "steal", "share": share})
                print(f"  round {rnd} {p:5s} {'cpu steal':22s} {'':9s} {100 * share:.1f}% of the CPU time", flush=True)
        if not args.servers:
            continue
        for p in args.precisions:
            for eng in order:
                port = free_port()
                cmd, env = (ours_server_command(p, port, args), None) if eng == OURS else peers[eng].server(p, port,
                                                                                                            args)
                res = serve_and_bench(f"{LABELS[eng]} server", cmd, port, work / f"r{rnd}-{p}-{eng}", args, env)
                rounds.append({"round": rnd, "precision": p, "engine": eng, "measurement": "servers",
                               **(res or {"missing": True})})
                for key in MEASUREMENTS:
                    if key.startswith("server"):
                        keep_best(best, p, eng, key, res and res.get(key))
                print(f"  round {rnd} {p:5s} {'servers':22s} {eng:9s} {describe_servers(res, args)}", flush=True)
    return best


def describe_servers(res: dict | None, args) -> str:
    if not res:
        return "MISSING"
    ttft = ", ".join(f"TTFT {res[k + '_input_tokens_mean']:.0f} tokens {res[k]:.0f} ms" for k in TTFT_BUCKETS
                     if res.get(k))
    return (f"c=1 decode {res['server_c1']:.1f} tok/s, c={args.batch} output {res['server_c16']:.1f} tok/s"
            + (f", {ttft}" if ttft else "") + f" (up in {res['start_s']:.0f} s)")


def kv_bytes_per_token(model: str) -> int:
    """K and V of one token over all layers in a 16-bit cache (ours and vLLM's bf16, llama.cpp's default f16)."""
    from leverlab.models.config import ModelConfig

    c = ModelConfig.from_folder(model)
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2


def decode_context(args) -> float:
    """The mean context a decode step attends over: the prompt, then half the decode span."""
    return args.prompt_len + args.decode_len / 2


def step_weights(args, prec: str, engine: str, batch, total: int | None) -> float | None:
    """The weight bytes one decode step of `batch` sequences ("batch": --batch; None: one) reads of an engine whose
    weights are `total` bytes. A dense model: all of them. A mixture of experts: all but the routed experts the step
    does not read; the share it reads is the experts per sparse layer our engine counted its router choosing in the
    same measurement (args.moe_hits), the same routing in every engine; where ours did not measure it, top-k at one
    sequence and, for a batch, the expectation under uniform routing, E * (1 - (1 - k/E)^n)."""
    moe = args.moe
    if not moe or total is None:
        return total
    routed = moe["routed_bytes"].get(prec, {}).get(engine)
    if routed is None:
        return total
    n = args.batch if batch == "batch" else (batch or 1)
    e, k = moe["experts"], moe["top_k"]
    hit = moe["hits"].get(prec, {}).get(n)
    if hit is None:
        hit = k if n == 1 else e * (1 - (1 - k / e) ** n)
    return total - routed * (1 - hit / e)


def moe_facts(model: str) -> dict | None:
    """{experts, top_k, routed_bytes: {precision: {engine: bytes}}, hits: {precision: {sequences: experts per
    sparse layer}}} for a mixture-of-experts checkpoint (filled in as the run learns them), else None."""
    from leverlab.models.config import ModelConfig

    c = ModelConfig.from_folder(model)
    return {"experts": c.num_experts, "top_k": c.num_experts_per_tok, "routed_bytes": {}, "hits": {}} \
        if c.is_moe else None


def step_bytes(weight_bytes: int, batch: int, args, with_kv: bool = True) -> float:
    """What one decode step of `batch` sequences reads: the weights once, and (with_kv) every sequence's KV cache."""
    return weight_bytes + (batch * decode_context(args) * args.kv_bytes_per_token if with_kv else 0)


def roofline_share(tok_s: float | None, weight_bytes: int | None, batch, bw: float | None, args,
                   with_kv: bool = True) -> float | None:
    """tok_s as a share of the bandwidth roofline: bw over the bytes one step reads (step_bytes: the engine's own
    weights and, with_kv, the KV cache), one step yielding `batch` tokens (MEASUREMENTS' second field). None where
    there is no roofline or no figure."""
    n = args.batch if batch == "batch" else batch
    if not (tok_s and weight_bytes and n and bw):
        return None
    return tok_s * step_bytes(weight_bytes, n, args, with_kv) / n / (bw * 1e9)


def shares_both_ways(best: dict, weight_bytes: dict, bw: float, args) -> dict:
    """{precision: {measurement: {engine: {"with_kv": share, "weights_only": share}}}} at bandwidth bw."""
    out: dict = {}
    for p in args.precisions:
        for key, m in MEASUREMENTS.items():
            for eng, v in best.get(p, {}).get(key, {}).items():
                w = step_weights(args, p, eng, m.roof, weight_bytes[p].get(eng))
                both = {name: roofline_share(v, w, m.roof, bw, args, with_kv)
                        for name, with_kv in (("with_kv", True), ("weights_only", False))}
                if any(x is not None for x in both.values()):
                    out.setdefault(p, {}).setdefault(key, {})[eng] = both
    return out


def print_block_shares(rounds: list, weight_bytes: dict, args) -> None:
    """Each decode rate's share of the roofline at the bandwidth measured just before its precision's block in the
    same round (not the run's best bandwidth, as the table above): the best round of each."""
    bws = {(r["round"], r["precision"]): r["gb_s"] for r in rounds if r["measurement"] == "bandwidth"}
    steals = {(r["round"], r["precision"]): r["share"] for r in rounds if r["measurement"] == "steal"}
    scales = {(r["round"], r["precision"]): r["x"] for r in rounds if r["measurement"] == "thread_scaling"}
    share: dict = {}
    block_of: dict = {}  # the (round, precision) block each best share came from
    for r in rounds:
        if r["measurement"] not in MEASUREMENTS:
            continue
        bw = bws.get((r["round"], r["precision"]))
        wb = step_weights(args, r["precision"], r["engine"], MEASUREMENTS[r["measurement"]].roof,
                          weight_bytes[r["precision"]].get(r["engine"]))
        v = roofline_share(r["tok_s"], wb, MEASUREMENTS[r["measurement"]].roof, bw, args)
        if v is not None:
            k = (r["precision"], r["measurement"], r["engine"])
            if v > share.get(k, 0.0):
                share[k], block_of[k] = v, (r["round"], r["precision"])
    if not share:
        return
    def cell(k) -> str:  # the best share of k, with what the host gave its block
        if not share.get(k):
            return "-"
        st, sc = steals.get(block_of[k]), scales.get(block_of[k])
        host = ([f"steal {100 * st:.1f}%"] if st is not None else []) + (
            [f"threads {sc:.2f}x"] if sc is not None else [])
        return f"{100 * share[k]:.0f}%" + (f" ({', '.join(host)})" if host else "")

    print("\nshare of the roofline at the bandwidth measured beside each block (best round; with the host's CPU "
          "steal during that block and the threads' compute scaling before it, where measured):")
    for p in args.precisions:
        for key, m in MEASUREMENTS.items():
            ks = [(p, key, e) for e in engines(args)]
            if any(share.get(k) for k in ks):
                print(f"  {p:5s} {m.label.format(batch=args.batch):22s} "
                      + ", ".join(f"{LABELS[k[2]]} {cell(k)}" for k in ks))


def precision_ratios(rounds: list, best: dict, args) -> dict:
    """Each precision's single stream over the first precision's (bf16 in the default order), per engine: the
    ratio of the best rounds (which may fall in different spells of a shared machine's bandwidth) and the ratio
    within each round (its two blocks minutes apart, not a round). {precision: {engine: {"best": r, "rounds": [r,
    ..]}}} (None where a figure is missing)."""
    base = args.precisions[0]
    rate = {(r["round"], r["precision"], r["engine"]): r["tok_s"] for r in rounds if r["measurement"] == "decode"}
    out: dict = {}
    for p in args.precisions[1:]:
        for eng in engines(args):
            a, b = best.get(p, {}).get("decode", {}).get(eng), best.get(base, {}).get("decode", {}).get(eng)
            per_round = []
            for rnd in range(1, args.rounds + 1):
                x, y = rate.get((rnd, p, eng)), rate.get((rnd, base, eng))
                per_round.append(x / y if x and y else None)
            out.setdefault(p, {})[eng] = {"best": a / b if a and b else None, "rounds": per_round}
    return out


def paired_precision_ratios(decode, args) -> dict | None:
    """Our single streams over the first precision's, measured generation by generation: each of --pair-reps reps
    decodes once in every precision (`decode(p)` -> tok/s, None where that precision is missing), in reverse order
    every other rep, so a figure and the base's it is divided by are seconds apart and share a spell of the
    machine's bandwidth (the rounds' blocks are minutes apart and may not). Returns {"reps": n, "tok_s": {p: [..]},
    "ratios": {p: {"median": median of the per-rep ratios, "best": best rep over best rep, "pairs": [..]}}}, or
    None without reps or without the base precision."""
    base = args.precisions[0]
    if args.pair_reps <= 0 or len(args.precisions) < 2:
        return None
    rates: dict[str, list] = {p: [] for p in args.precisions}
    for rep in range(args.pair_reps):
        for p in args.precisions if rep % 2 == 0 else args.precisions[::-1]:
            rates[p].append(decode(p))
    if any(v is None for v in rates[base]):
        return None
    ratios = {}
    for p in args.precisions[1:]:
        if any(v is None for v in rates[p]):
            continue
        pairs = [a / b for a, b in zip(rates[p], rates[base])]
        ratios[p] = {"median": statistics.median(pairs), "best": max(rates[p]) / max(rates[base]), "pairs": pairs}
    return {"reps": args.pair_reps, "tok_s": rates, "ratios": ratios}


def print_paired_ratios(paired: dict | None, args) -> None:
    if not paired or not paired["ratios"]:
        return
    base = args.precisions[0]
    print(f"\nour single stream over {base}'s, generation by generation ({paired['reps']} reps, every precision once a "
          f"rep, seconds apart; {base} {statistics.median(paired['tok_s'][base]):.1f} tok/s median): the median of "
          "the reps' ratios, the best rep over the best rep, and rep by rep:")
    for p, r in paired["ratios"].items():
        print(f"  {p:5s} LeverLab {r['median']:.2f}x median, {r['best']:.2f}x best "
              f"({', '.join(f'{x:.2f}x' for x in r['pairs'])})")


def print_precision_ratios(ratios: dict, args) -> None:
    if not ratios:
        return
    fmt = lambda v: f"{v:.2f}x" if v else "-"  # noqa: E731
    print(f"\nsingle stream over {args.precisions[0]}'s, best rounds (and round by round):")
    for p, per in ratios.items():
        cells = [f"{LABELS[e]} {fmt(r['best'])} ({', '.join(fmt(v) for v in r['rounds'])})" for e, r in per.items()]
        print(f"  {p:5s} " + "; ".join(cells))


def print_notes(rounds: list, weight_bytes: dict, args) -> None:
    inputs = {(r["precision"], r["engine"]): r.get("input_tokens_mean") for r in rounds
              if r["measurement"] == "servers" and r.get("input_tokens_mean")}
    for p in args.precisions:
        for eng in args.peers:
            a, b = inputs.get((p, OURS)), inputs.get((p, eng))
            if a and b and abs(a - b) > 0.5:
                why = "the GGUF's pre-tokenizer or BOS differs from ours" if eng == "llamacpp" else "its tokenizer differs"
                print(f"note: the servers counted different prompt lengths for {p} ({a:.1f} vs {b:.1f} tokens, mean, "
                      f"LeverLab vs {LABELS[eng]}): {why}", flush=True)
    l3 = l3_bytes()
    small = [p for p in args.precisions if l3 and max(filter(None, weight_bytes[p].values()), default=l3) < l3]
    if small:
        print(f"note: the weights of {small} fit in one L3 ({l3 / 2**20:.0f} MiB): a step can read them from "
              f"cache, so shares of the memory roofline above 100% are possible and say little there.")


def l3_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        s = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(s[:-1]) * {"K": 2**10, "M": 2**20}[s[-1]] if s[-1] in "KM" else int(s)
    return None


def print_table(best: dict, weight_bytes: dict, bw: float, args, formats: dict | None = None,
                binding: dict | None = None) -> None:
    """Best round of each engine, ours over each peer's (how many times faster: > 1, ours is), and each decode rate's
    share of that engine's roofline: bandwidth over the bytes one step reads, its own weights and the KV cache (one
    step yields `batch` tokens). formats: {precision: {peer: its weights' name}}; binding: {engine: threads}."""
    kv_mb = args.kv_bytes_per_token * decode_context(args) / 1e6
    names = engines(args)
    print(f"\nbest of {args.rounds} round(s), {args.threads} thread(s); roofline at {bw:.1f} GB/s over the weights "
          f"and the KV cache ({kv_mb:.1f} MB a sequence at the mean context of {decode_context(args):.0f} tokens); "
          "LeverLab / peer: how many times faster ours is (TTFT: the peer's time over ours)")
    head = ["precision", "measurement", "unit", LABELS[OURS]]
    for e in args.peers:
        head += [LABELS[e], f"LeverLab / {LABELS[e]}"]
    head += [f"{LABELS[e]} % roofline" for e in names]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for p in args.precisions:
        for key, m in MEASUREMENTS.items():
            b = best.get(p, {}).get(key, {})
            if not b and (key.startswith("server") and not args.servers
                          or key in IN_PROCESS and key not in args.measurements):
                continue
            fmt = (lambda v: f"{v:.0f}" if v else "missing") if m.unit == "ms" else (
                lambda v: f"{v:.1f}" if v else "missing")
            cells = [p, m.label.format(batch=args.batch), m.unit, fmt(b.get(OURS))]
            for e in args.peers:
                r = speed_ratio(key, b.get(OURS), b.get(e))
                cells += [fmt(b.get(e)), f"{r:.2f}x" if r else "-"]
            for e in names:
                share = roofline_share(b.get(e), step_weights(args, p, e, m.roof, weight_bytes[p].get(e)), m.roof,
                                       bw, args)
                cells.append(f"{100 * share:.0f}%" if share is not None else "-")
            print("| " + " | ".join(cells) + " |")
    for p in args.precisions:
        mb = {e: f"{w / 1e6:.1f} MB" if w else "?" for e, w in weight_bytes[p].items()}
        if args.moe:  # what a step reads: one sequence's experts, and a batch's
            mb = {e: " / ".join(f"{w / 1e6:.1f}" if w else "?" for w in (
                step_weights(args, p, e, 1, weight_bytes[p].get(e)),
                step_weights(args, p, e, "batch", weight_bytes[p].get(e)))) + f" MB at 1 / {args.batch} sequences"
                for e in weight_bytes[p]}
        fm = (formats or {}).get(p, {})
        each = ", ".join(f"{LABELS[e]} {mb.get(e, '?')}" + (f" ({fm[e]})" if e in fm else "") for e in names)
        print(f"  {p}: weights read per step: {each}; KV cache {kv_mb:.1f} MB a sequence")
    if binding:
        print("  threads: " + "; ".join(f"{LABELS[e]} {b}" for e, b in binding.items()))


if __name__ == "__main__":
    sys.exit(main())
