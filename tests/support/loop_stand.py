"""A prefill loop and a decode loop in one process, over the ``local`` transfer backend.

Shared by ``tests/prefill`` and ``tests/decode``: the real ``PrefillLoop`` and ``DecodeLoop``
with their real KV managers (control threads, ZMQ control channel, a real bootstrap server on
a free port), real page pools, and a deterministic stand-in model (``EchoRunner``) instead of a
checkpoint: the loops' scheduling state is what these tests check; the real model paths are
covered by the multi-process stands (``tests/pd``).

``EchoRunner`` writes each token id into its KV slot (every layer, K and V), then reads the
whole sequence back through the page table and derives the next token from it. A decode whose
pages did not receive the prefill's KV (wrong page, lost chunk, page reused too early) therefore
raises, and every output is checked against ``reference``. Timeouts run on a ``FakeClock``
shared by both KV managers and the decode's quarantine.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from pdserve.decode.decode_loop import DecodeLoop
from pdserve.engine.config import EngineConfig
from pdserve.engine.messages import BootstrapInfo, TokenizedGenerateReq, TokenOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.speculative.nextn_handoff import aux_hidden_bytes
from pdserve.kvtransfer.bootstrap_server import BootstrapServer
from pdserve.engine.kv_transfer_config import KVTransferConfig
from pdserve.kvtransfer.decode_kv_manager import DecodeKVManager
from pdserve.kvtransfer.prefill_kv_manager import PrefillKVManager
from pdserve.prefill.prefill_loop import PrefillLoop

VOCAB = 1000
PS = 4  # page size
LAYERS = 2


def next_token(seq: list[int]) -> int:
    h = 7
    for t in seq:
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


@dataclass(frozen=True)
class EchoArch:
    vocab_size: int = VOCAB
    max_context_len: int = 4096
    eos_token_ids: tuple[int, ...] = ()


class EchoRunner:
    """What ``SchedulerLoop`` needs of a ``ModelRunner``: arch, tokenizer, page pool, device, forward."""

    def __init__(self, num_pages: int, config: EngineConfig):
        self.arch = EchoArch()
        self.tokenizer = None
        self.device = torch.device("cpu")
        # the weights' quantization from the config, as ModelRunner does (the KV layout carries it)
        self.page_pool = PagePool(num_pages, PS, LAYERS, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                                  quantization=config.quantization)
        # the model's identity, as ModelRunner sets it (the PD pairing compares it): the path stands for it
        self.page_pool.model = f"echo {config.model_path}" if config.model_path else ""
        # tests of the layer-wise send: called with each layer after its KV is stored, the forward paused
        self.layer_probe = None
        # speculative decoding's verify steps ask for a row per fed token (prompt logprob rows stay unsimulated)
        self.score_all_rows = config.speculative_algorithm is not None

    def forward(self, fb, after_layer=None) -> torch.Tensor:
        pool = self.page_pool
        for layer in range(LAYERS):
            # K holds the token (+ layer, so a layer mix-up shows), V the position
            pool.k_slots(layer)[fb.out_cache_loc, 0, :] = (fb.input_ids + layer).float().unsqueeze(1)
            pool.v_slots(layer)[fb.out_cache_loc, 0, :] = fb.positions.float().unsqueeze(1)
            if after_layer is not None:  # as the real model: once the layer's KV is stored
                after_layer(layer)
            if self.layer_probe is not None:
                self.layer_probe(layer)
        wanted = fb.logits_indices.tolist()
        rows = {}  # logits row -> next token of the sequence up to that row's position
        offset = 0
        for i, (n, seq_len) in enumerate(zip(fb.extend_lens, fb.seq_lens)):
            offset += n
            t = torch.arange(seq_len)
            slots = fb.page_table[i].long()[t // PS] * PS + t % PS
            seq = [int(x) for x in pool.k_slots(0)[slots, 0, 0].tolist()]
            for layer in range(1, LAYERS):
                got = [int(x) - layer for x in pool.k_slots(layer)[slots, 0, 0].tolist()]
                assert got == seq, f"layer {layer} KV differs from layer 0 in sequence {i}"
            assert pool.v_slots(LAYERS - 1)[slots, 0, 0].tolist() == [float(p) for p in range(seq_len)], (
                f"sequence {i}: KV positions are not 0..{seq_len - 1} (a page lost or overwritten)")
            # a verify step scores every fed token: row ``offset - 1 - j`` sees the sequence up to j tokens less
            for j in range(n):
                if offset - 1 - j in wanted and (j == 0 or self.score_all_rows):
                    rows[offset - 1 - j] = next_token(seq[: seq_len - j])
        assert len(rows) == len(wanted), "prompt logprob rows are not simulated"
        logits = torch.zeros(len(wanted), VOCAB)
        logits[torch.arange(len(wanted)), torch.tensor([rows[r] for r in wanted], dtype=torch.long)] = 10.0
        return logits

    def model_families(self) -> list:
        """No model families: the echo model has no experts (``ModelRunner.model_families``)."""
        return []


class FakeClock:
    """The KV managers' (and the decode quarantine's) clock; tests move it."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


_rooms = itertools.count(1)
# timeouts far beyond a test's real run time; the timeout tests move the FakeClock past them
KV_DEFAULTS = dict(bootstrap_timeout=30.0, waiting_timeout=30.0, quarantine_timeout=60.0,
                   heartbeat_interval=10_000.0, num_transfer_threads=1, aux_num_slots=16)


class PDPair:
    """One prefill loop and one decode loop, stepped in turn by ``run``."""

    def __init__(self, p_pages: int = 64, d_pages: int = 64, p_engine: dict | None = None,
                 d_engine: dict | None = None, d_transfer_engine=None, d_max_local_prefill_tokens: int = 0,
                 p_transfer_engine=None, p_runner=None, d_runner=None, **kv):
        """``d_transfer_engine``, ``p_transfer_engine``: the decode's and the prefill's transfer engines
        (default: one of ``kv``'s backend). ``p_runner``, ``d_runner``: real models instead of the
        ``EchoRunner`` (their configs' page size must be ``PS``)."""
        self.clock = FakeClock()
        bootstrap_auth = KVTransferConfig(backend="local", auth_key_file=kv.get("auth_key_file", "")).frame_auth("bootstrap")
        self.bootstrap = BootstrapServer("127.0.0.1", 0, auth=bootstrap_auth).start_in_thread()
        cfg = KVTransferConfig(backend="local", bootstrap_port=self.bootstrap.port, **{**KV_DEFAULTS, **kv})
        self.kv_config = cfg
        p_cfg = EngineConfig(page_size=PS, **(p_engine or {}))
        d_cfg = EngineConfig(page_size=PS, **(d_engine or {}))
        p_runner, d_runner = p_runner or EchoRunner(p_pages, p_cfg), d_runner or EchoRunner(d_pages, d_cfg)
        p_kv = PrefillKVManager(cfg, p_runner.page_pool, engine=p_transfer_engine, clock=self.clock,
                                aux_hidden_bytes=aux_hidden_bytes(p_cfg.speculative_algorithm, p_runner)).start()
        d_kv = DecodeKVManager(cfg, d_runner.page_pool, engine=d_transfer_engine, clock=self.clock,
                               aux_hidden_bytes=aux_hidden_bytes(d_cfg.speculative_algorithm, d_runner)).start()
        self.prefill = PrefillLoop(p_cfg, p_kv, runner=p_runner)
        self.decode = DecodeLoop(d_cfg, d_kv, runner=d_runner, max_local_prefill_tokens=d_max_local_prefill_tokens)
        assert p_kv.registered.wait(10) and p_kv.registration_error is None
        self.outputs: dict[str, list[TokenOutput]] = {}  # "P:rid" / "D:rid" -> outputs in order
        self.steps = 0

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self.bootstrap.stop_thread()

    # ------------------------------------------------------------------ requests
    def submit(self, rid: str, prompt: list[int], max_new: int = 4, to: str = "PD", room: int | None = None,
               **kw) -> int:
        """Send the request to the prefill (P), the decode (D) or both, as a router would; returns its room."""
        room = next(_rooms) if room is None else room
        boot = BootstrapInfo("127.0.0.1", self.bootstrap.port, room, 0)
        msg = TokenizedGenerateReq(rid, list(prompt), SamplingParams(max_new_tokens=max_new, temperature=0.0),
                                   bootstrap=boot, **kw)
        if "P" in to:
            self.prefill.add_request(msg)
        if "D" in to:
            self.decode.add_request(msg)
        return room

    def final(self, side: str, rid: str) -> TokenOutput | None:
        outs = self.outputs.get(f"{side}:{rid}", [])
        return outs[-1] if outs and outs[-1].finished else None

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(f"D:{rid}", []) for t in o.new_token_ids]

    # ---------------------------------------------------------------------- steps
    def step(self, prefill: bool = True, decode: bool = True) -> None:
        """One step of each loop, then every page of both pools accounted for."""
        for side, loop, on in (("P", self.prefill, prefill), ("D", self.decode, decode)):
            if not on:
                continue
            for out in loop.step():
                self.outputs.setdefault(f"{side}:{out.rid}", []).append(out)
            loop.check_integrity()
        self.steps += 1

    def run(self, until, timeout: float = 5.0, **step_kw) -> None:
        """Step until ``until()`` holds; waits briefly (KV control threads) when nothing moved."""
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached in {timeout}s; outputs: {self.outputs}")
            self.step(**step_kw)
            time.sleep(0.0002)

    def done(self, *rids: str, sides: str = "PD"):
        return lambda: all(self.final(s, r) is not None for r in rids for s in sides)

    def settle(self) -> None:
        """Until both loops are idle, then check that every page is free or in a prefix cache."""
        self.run(lambda: not self.prefill.has_work() and not self.decode.has_work())
        for loop in (self.prefill, self.decode):
            loop.check_integrity()
            loop.flush_cache()
            assert loop.pool.num_free == loop.pool.capacity, f"pages still used: {loop.pool.used_pages()}"
        assert self.decode.kv.aux_pool.num_free == self.decode.kv.aux_pool.num_slots
