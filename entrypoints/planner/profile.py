"""A server profile: how long prefill takes against input length and how long a decode step takes
against batch size and context length, measured on one machine for one server configuration.

Stored as JSON (msgspec). ``ServerDescription`` names everything that changes the figures (model,
dtype, quantization, TP size, page and chunk sizes, threads); ``check_matches`` refuses a profile
taken for another configuration with a message naming each field that differs.
"""

from __future__ import annotations

import os
import platform
import socket
import time

import msgspec

PROFILE_VERSION = 1


class ProfileMismatch(ValueError):
    """A profile describes other servers than those in use."""


class MachineInfo(msgspec.Struct, frozen=True, kw_only=True):
    hostname: str
    cpu: str  # the CPU's model name (or the accelerator's, where there is one)
    cores: int  # cores this process could use when it measured
    platform: str


class ServerDescription(msgspec.Struct, frozen=True, kw_only=True):
    """What the profile's figures depend on; two servers with equal descriptions perform alike."""

    model: str  # model path or name as the server reports it
    dtype: str = "auto"
    quantization: str = "none"
    tp_size: int = 1
    page_size: int = 16
    chunked_prefill_size: int = 2048
    num_threads: int = 0  # torch threads per rank (0: the server's default)
    max_total_tokens: int = 0  # KV tokens of one server (0: not known)

    def differences(self, other: "ServerDescription") -> list[str]:
        """``field: mine != theirs`` for each field that differs (``max_total_tokens`` 0 matches any)."""
        out = []
        for name in self.__struct_fields__:
            a, b = getattr(self, name), getattr(other, name)
            if name == "max_total_tokens" and 0 in (a, b):
                continue
            if a != b:
                out.append(f"{name}: {a!r} != {b!r}")
        return out


class PrefillPoint(msgspec.Struct, frozen=True):
    input_len: int
    ttft_s: float  # one request alone on an idle server: its time to first token


class DecodePoint(msgspec.Struct, frozen=True):
    batch_size: int
    context_len: int
    itl_s: float  # mean time between tokens with batch_size sequences of context_len running


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    version: int = PROFILE_VERSION
    machine: MachineInfo
    server: ServerDescription
    created: float = 0.0  # unix time of the measurement
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    note: str = ""  # how it was measured (command, mode)

    def __post_init__(self):
        if self.version != PROFILE_VERSION:
            raise ValueError(f"profile version {self.version} is not {PROFILE_VERSION}")
        if not self.prefill:
            raise ValueError("prefill: a profile needs at least one prefill point")
        if not self.decode:
            raise ValueError("decode: a profile needs at least one decode point")
        for p in self.prefill:
            if p.input_len < 1 or not p.ttft_s > 0:
                raise ValueError(f"prefill: input_len >= 1 and ttft_s > 0, got {p}")
        for d in self.decode:
            if d.batch_size < 1 or d.context_len < 1 or not d.itl_s > 0:
                raise ValueError(f"decode: batch_size, context_len >= 1 and itl_s > 0, got {d}")


def check_matches(profile: Profile, server: ServerDescription, source: str = "profile") -> None:
    """Raise ProfileMismatch naming every difference between the profile's servers and ``server``."""
    diff = profile.server.differences(server)
    if diff:
        raise ProfileMismatch(f"{source} was taken for other servers than those in use: " + "; ".join(diff))


def this_machine() -> MachineInfo:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return MachineInfo(hostname=socket.gethostname(), cpu=cpu or "unknown",
                       cores=len(os.sched_getaffinity(0)), platform=platform.platform())


def save(profile: Profile, path: str) -> None:
    with open(path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(profile), indent=2))


def load(path: str) -> Profile:
    """The profile in ``path``; ValueError naming the file and the field on bad content."""
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=Profile)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a pdserve profile: {e}") from None


def new_profile(server: ServerDescription, prefill, decode, note: str = "") -> Profile:
    return Profile(machine=this_machine(), server=server, created=time.time(),
                   prefill=tuple(sorted(prefill, key=lambda p: p.input_len)),
                   decode=tuple(sorted(decode, key=lambda d: (d.batch_size, d.context_len))), note=note)
