"""A profile with round numbers for the planner's unit tests: prefill TTFT = 0.05 + 0.0005 x input
length; decode ITL = 0.02 + 0.001 b + 0.00001 b x context (b sequences of context tokens)."""

from pdserve.entrypoints.planner.profile import (DecodePoint, MachineInfo, PrefillPoint, Profile,
                                            ServerDescription)

SERVER = ServerDescription(model="synthetic", dtype="bfloat16", max_total_tokens=0)


def ttft(n: int) -> float:
    return 0.05 + 0.0005 * n


def itl(b: int, ctx: int) -> float:
    return 0.02 + 0.001 * b + 0.00001 * b * ctx


def synthetic_profile(server: ServerDescription = SERVER) -> Profile:
    return Profile(
        machine=MachineInfo(hostname="test", cpu="synthetic", cores=1, platform="test"),
        server=server,
        prefill=tuple(PrefillPoint(n, ttft(n)) for n in (64, 256, 1024, 4096)),
        decode=tuple(DecodePoint(b, c, itl(b, c)) for c in (256, 1024, 4096) for b in (1, 4, 16, 64)),
    )
