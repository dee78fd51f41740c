"""The tensor-parallel process group on torch.distributed, and how its ranks are started.

Two groups over the same ranks: the default (*compute*) group carries the all-reduces and gathers
inside a step, and its timeout (`distributed_timeout_s`) bounds both the rendezvous and a hung rank;
the *control* group carries each step's inputs from rank 0, with a long timeout, since workers wait
there while the server is idle.
A rank that dies closes its sockets, so the others' next collective raises at once.

Single node: rank 0 (the engine) spawns ranks 1..N-1 itself and meets them on a free loopback port.
Several nodes: every rank is started from outside with torchrun-style variables (MASTER_ADDR,
MASTER_PORT, WORLD_SIZE, RANK); rank 0 runs the engine (and the server), the others `hasten serve`
turns into workers (hasten/distributed/worker.py).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT = datetime.timedelta(days=365)


class TensorParallelError(RuntimeError):
    """A rank of the tensor- or pipeline-parallel group died or stopped answering; the engine cannot go on."""


def external_launch() -> dict[str, Any] | None:
    """torchrun-style rank variables, if this process was started with them (WORLD_SIZE > 1)."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in env:
        return None
    addr, port = env.get("MASTER_ADDR", "127.0.0.1"), env.get("MASTER_PORT", "29500")
    return {"rank": int(env["RANK"]), "world": int(env["WORLD_SIZE"]), "init_method": f"tcp://{addr}:{port}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ParallelGroup:
    rank: int
    world: int
    control: Any  # the process group rank 0 broadcasts each step's inputs on
    tp_size: int = 1  # the ranks of one pipeline stage, which split each of its layers
    tp_group: Any = None  # their process group (None: every rank, when there is a single stage)
    processes: list[Any] = field(default_factory=list)  # the ranks rank 0 spawned (single node)
    rank_weight_bytes: list[int] = field(default_factory=list)  # each rank's resident weights, measured at load
    closed: bool = False
    broken: bool = False  # a step failed midway on this rank: the ranks are out of step, no more steps
    collective_s: float = 0.0  # time this rank spent in the in-step collectives (all-reduce, gather, p2p)
    collective_calls: int = 0

    @classmethod
    def join(cls, rank: int, world: int, init_method: str, timeout_s: float, tp_size: int = 0,
             backend: str = "gloo", processes: list[Any] | None = None) -> ParallelGroup:
        """tp_size: ranks per pipeline stage (0: all of them, tensor parallelism only). Stage s is
        global ranks s * tp_size .. (s + 1) * tp_size - 1."""
        tp_size = tp_size or world
        if world % tp_size:
            raise ValueError(f"{world} ranks do not form stages of {tp_size}")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # the control messages go over gloo whatever the compute backend (they are pickled host objects)
        control = dist.new_group(list(range(world)), timeout=CONTROL_TIMEOUT, backend="gloo")
        layout = [tp_size]  # every rank must create the same stage groups: rank 0's layout decides
        dist.broadcast_object_list(layout, src=0, group=control)
        if layout[0] != tp_size:
            dist.destroy_process_group()
            raise ValueError(f"rank {rank} was started with {tp_size} tensor-parallel ranks per stage, rank 0 with "
                             f"{layout[0]}: start every rank with the same --tensor-parallel-size and "
                             "--pipeline-parallel-size")
        tp_group = None
        if 1 < tp_size < world:  # every rank creates every stage's group, in the same order
            for first in range(0, world, tp_size):
                g = dist.new_group(list(range(first, first + tp_size)), backend=backend,
                                   timeout=datetime.timedelta(seconds=timeout_s))
                if first <= rank < first + tp_size:
                    tp_group = g
        return cls(rank, world, control, tp_size, tp_group, processes or [])

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    # ------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over this stage's tensor-parallel ranks (nothing to do without tensor parallelism)."""
        if self.tp_size > 1:
            self._timed(dist.all_reduce, t, group=self.tp_group)
        return t

    def all_gather_cols(self, local: torch.Tensor, step: int, total: int) -> torch.Tensor:
        """[rows, <= step] on each TP rank of the stage -> [rows, total] (their columns in rank order)."""
        if self.tp_size == 1:
            return local
        if local.shape[1] < step:
            local = torch.nn.functional.pad(local, (0, step - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        self._timed(dist.all_gather, parts, local.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=1)[:, :total]

    def broadcast_object(self, obj: Any = None) -> Any:
        box = [obj]
        self._guard(dist.broadcast_object_list, box, src=0, group=self.control)
        return box[0]

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        return self._guard(dist.isend, t, dst, tag=tag)

    def recv(self, t: torch.Tensor, src: int, tag: int) -> None:
        self._timed(dist.recv, t, src, tag=tag)

    def wait(self, work: Any) -> None:
        self._timed(work.wait)

    def gather_int(self, value: int) -> list[int]:
        """Every rank's `value`, in rank order, on every rank: over the compute group, so a rank that
        hangs (say, while loading) fails the others after distributed_timeout_s."""
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._guard(dist.all_gather, parts, torch.tensor([value], dtype=torch.int64))
        return [int(p) for p in parts]

    def _timed(self, fn, *args, **kwargs) -> None:
        t0 = time.perf_counter()
        self._guard(fn, *args, **kwargs)
        self.collective_s += time.perf_counter() - t0
        self.collective_calls += 1

    def _guard(self, fn, *args, **kwargs) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            raise TensorParallelError(f"rank {self.rank}: {self.describe_failure(exc)}") from exc

    def describe_failure(self, exc: BaseException) -> str:
        dead = [f"rank {i + 1} exited with code {p.exitcode}" for i, p in enumerate(self.processes)
                if p.exitcode is not None]
        why = "; ".join(dead) if dead else "a peer rank closed its connection or timed out"
        return f"{why} ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Rank 0: tell the workers to stop, then leave the group."""
        if self.closed:
            return
        self.closed = True
        if self.rank == 0:
            if not self.broken:  # workers inside a failed step's collective cannot take a message
                try:
                    self.broadcast_object(("stop",))
                except TensorParallelError:
                    pass
            for p in self.processes:
                p.join(timeout=10 if not self.broken else 0.5)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()


def threads_per_rank(world: int, requested: int | None) -> int:
    """Intra-op threads of each rank: the request, else this machine's cores shared out."""
    if requested:
        return requested
    return max(1, (os.cpu_count() or 1) // world)
