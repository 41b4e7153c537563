"""Failure injection for the simulated replica (`sim_replica.py`): what a sick server does to a router.

Set at start (`SimReplicaConfig.failure`) or live (`POST /admin/fail {"mode": "error500", ...}`).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from aiohttp import web


class FailMode(enum.Enum):
    NONE = "none"
    REFUSE = "refuse"  # close the connection without a response
    UNAVAILABLE = "unavailable"  # 503 with an OpenAI error body and Retry-After
    ERROR500 = "error500"  # 500 with an OpenAI error body, before any byte of a response
    STALL = "stall"  # accept and never answer
    DIE_MID_STREAM = "die_mid_stream"  # send `die_after_chunks` chunks, then drop the connection
    SLOW_FIRST_BYTE = "slow_first_byte"  # wait `slow_first_byte_s` before serving normally


# Modes that also hit /health, so active health checks see what clients see.
HEALTH_FAILS = (FailMode.REFUSE, FailMode.UNAVAILABLE, FailMode.ERROR500, FailMode.STALL)


@dataclass(frozen=True)
class FailureSpec:
    mode: FailMode = FailMode.NONE
    fail_after_n: int = 0  # inference requests served normally (from when the mode was set) before failing
    slow_first_byte_s: float = 2.0
    die_after_chunks: int = 2  # SSE chunks (role chunk included) sent before the connection drops


class FailureState:
    """The current failure spec and how many inference requests it has let through."""

    def __init__(self, spec: FailureSpec) -> None:
        self.spec = spec
        self.num_passed = 0
        self.num_injected = 0

    def set(self, spec: FailureSpec) -> None:
        self.spec = spec
        self.num_passed = 0

    def active(self) -> bool:
        return self.spec.mode is not FailMode.NONE and self.num_passed >= self.spec.fail_after_n

    def take(self) -> FailMode:
        """Decide for one inference request: the mode to inject, or NONE (counted toward fail_after_n)."""
        if self.active():
            self.num_injected += 1
            return self.spec.mode
        self.num_passed += 1
        return FailMode.NONE


def drop_connection(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()


async def stall() -> None:
    await asyncio.get_running_loop().create_future()  # cancelled when the client goes away or on shutdown
