"""Faults injected into ranks and sweep workers (module-level functions, importable by spawned processes and
Ray workers): a rank that stops (SIGSTOP: a stalled rank) or dies (SIGKILL) while the others wait for it in
a collective, and a sweep point whose worker process dies."""
from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

from fadev import distributed as fd

SIGNALS = {"stop": signal.SIGSTOP, "kill": signal.SIGKILL}


def ring_with_a_fault(rank, world, how):
    """Rank 1 stops or dies before its ring call; rank 0's ring waits for it in its first collective."""
    if rank == 1:
        os.kill(os.getpid(), SIGNALS[how])
    q = torch.zeros(1, 1, 4, 8)
    fd.ring_attention(q, q, q, "fa2:bf16")


def stalled_study(rank, world, cfg, path):
    """A ring-dist study whose rank 1 stops while rank 0 waits for it at a barrier."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier()


def dying_study(rank, world, cfg, path):
    """A ring-dist study whose rank 1 dies while rank 0 waits for it at a barrier."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def dying_point(point):
    """A sweep point whose worker process dies (a node lost, the OOM killer)."""
    os._exit(3)
