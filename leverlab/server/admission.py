"""Admission: what the server takes on, decided before it spends work on a request.

Two counts, both reserved before the work they guard and released when the request ends:
- body bytes being read or parsed (at most `max_bytes` in flight), reserved from Content-Length before the
  body is read;
- sequences (prompts x n) running or waiting, at most the engine's `capacity_seqs`, reserved after the body
  is parsed and before anything is tokenized.
A request that can never fit (a body over the per-request limit, more sequences than the capacity) gets a
4xx saying so; one that can fit later gets 503 + Retry-After (EngineOverloaded), and nothing else does.
"""

from __future__ import annotations

from leverlab.errors import EngineOverloaded
from leverlab.server.protocol import BadRequest


class Ticket:
    """A reservation; release() is idempotent, so every exit path may call it."""

    def __init__(self, gate: Admission, seqs: int = 0, nbytes: int = 0):
        self.gate, self.seqs, self.nbytes = gate, seqs, nbytes

    def release(self) -> None:
        g = self.gate
        g.seqs -= self.seqs
        g.bytes -= self.nbytes
        self.seqs = self.nbytes = 0


class Admission:
    """Counts on the event loop only (no lock needed: reserve and release run there)."""

    def __init__(self, max_seqs: int, max_bytes: int, max_body_bytes: int):
        self.max_seqs, self.max_bytes, self.max_body_bytes = max_seqs, max_bytes, max_body_bytes
        self.seqs = 0
        self.bytes = 0

    def reserve_bytes(self, nbytes: int) -> Ticket:
        if nbytes > self.max_body_bytes:
            raise BadRequest(f"request body is larger than {self.max_body_bytes} bytes", status=413)
        if self.bytes and self.bytes + nbytes > self.max_bytes:
            raise EngineOverloaded(f"{self.bytes} bytes of request bodies are being read; retry later")
        self.bytes += nbytes
        return Ticket(self, nbytes=nbytes)

    def grow_bytes(self, ticket: Ticket, nbytes: int) -> None:
        """A body without Content-Length: count it as it arrives."""
        if ticket.nbytes + nbytes > self.max_body_bytes:
            raise BadRequest(f"request body is larger than {self.max_body_bytes} bytes", status=413)
        ticket.nbytes += nbytes
        self.bytes += nbytes

    def reserve_seqs(self, num_prompts: int, n: int) -> Ticket:
        seqs = num_prompts * n
        if seqs > self.max_seqs:
            raise BadRequest(
                f"this request asks for {seqs} sequences ({num_prompts} prompt(s) x n={n}); the server runs "
                f"or queues at most {self.max_seqs} at once (--max-num-seqs + --max-waiting), so it can never "
                "be admitted: send fewer prompts or a smaller n",
                "n" if num_prompts == 1 else "prompt",
            )
        if self.seqs + seqs > self.max_seqs:
            raise EngineOverloaded(
                f"{self.seqs} sequences are running or waiting (at most {self.max_seqs}); retry later")
        self.seqs += seqs
        return Ticket(self, seqs=seqs)
