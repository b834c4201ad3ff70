"""NEXTN through PD: the prompt's last hidden state, from the prefill's target to the decode's MTP.

The MTP layer drafts from the target's final-normed hidden state (``nextn.py``), and a PD decode
never runs the prompt. So a prefill started with ``--speculative-algorithm NEXTN`` keeps its
target's hidden rows (``keep_hidden``) and sends h_{P-1}, the state at the last of the P prompt
positions, with the first token in the room's aux slot (``kvtransfer/aux_pool.py``), as SGLang's
prefill servers of an EAGLE/MTP deployment send their hidden states: ``hidden_size`` values in the
model's dtype, as raw bytes. The decode's proposer starts from it at position P - 1, so its
first step already drafts. A decode whose room came without it fails the request naming the flag,
rather than drafting from zeros.

The MTP's own KV for the prompt comes too: both sides' pools hold one layer more than the model
(``mtp_kv_layers``), the prefill's MTP writes its prompt rows there (``nextn_prompt.py``), and the
pages carry them as any layer's. The decode's MTP copies them into its own pool (``PromptKV``,
``NextNProposer.observe_prompt``) and starts with the prompt's KV, as colocated. A prefill not
started with NEXTN has one layer less, so the decode's pool is refused at registration, naming
both layer counts.

Hidden states are the same on every TP rank (the final norm follows the all-reduce), so the one
prefill rank that writes a room's aux data sends it, whatever the two sides' TP sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.speculative_names import NEXTN

NO_HIDDEN_STATE = (f"the prefill sent no hidden state of the prompt's last token, which speculative_algorithm "
                   f"{NEXTN} drafts from: start the prefill server with --speculative-algorithm {NEXTN} too")


def mtp_kv_layers(speculative_algorithm: str | None) -> int:
    """Layers a PD rank's page pool holds past the model's: the MTP layer's, under NEXTN. Both
    sides of a pair need the same (the transfer refuses other layer counts at registration)."""
    return 1 if speculative_algorithm == NEXTN else 0


@dataclass(frozen=True)
class PromptKV:
    """Where a decode's request holds the MTP layer's KV of its prompt positions ``0 .. count - 1``
    as the prefill sent it: layer ``layer`` of ``pool``, the request's ``pages`` (token t in slot
    ``pages[t // page_size] * page_size + t % page_size``)."""

    pool: object  # PagePool
    layer: int
    pages: list[int]
    count: int


def check_target(model, arch_name: str) -> None:
    """Refuse, by name, a model whose last hidden state NEXTN cannot use (not DeepSeek-V2/V3)."""
    from pdserve.engine.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM

    if not isinstance(model, DeepseekV2ForCausalLM):
        raise ValueError(f"speculative_algorithm {NEXTN} drafts with a DeepSeek-V2/V3 checkpoint's MTP layers; "
                         f"{arch_name} has none")


def handoff_bytes(hidden_size: int, dtype: torch.dtype) -> int:
    """The bytes of one hidden state in the aux slot."""
    return hidden_size * dtype.itemsize


def last_prompt_rows(reqs, extend_lens, sample, hidden: torch.Tensor) -> dict[str, bytes]:
    """Per request of a prefill batch whose last chunk this was (``sample``), the raw bytes of its
    last row of ``hidden`` [num_tokens, hidden_size] (rows in batch order)."""
    out: dict[str, bytes] = {}
    end = 0
    for req, n, last in zip(reqs, extend_lens, sample):
        end += n
        if last:
            out[req.rid] = hidden[end - 1].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return out


def hidden_row(raw: bytes, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, hidden_size] of ``dtype`` on ``device``: a hidden state from its bytes."""
    if len(raw) != handoff_bytes(hidden_size, dtype):
        raise ValueError(f"hidden state of {len(raw)} bytes, expected {hidden_size} values of {dtype}")
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(1, hidden_size).to(device)


def aux_hidden_bytes(speculative_algorithm: str | None, runner) -> int:
    """What a PD rank of ``runner``'s model sends (prefill) or makes room for (decode) in each aux
    slot: one hidden state under NEXTN, else nothing."""
    if speculative_algorithm != NEXTN:
        return 0
    check_target(runner.model, runner.arch.arch)
    return handoff_bytes(runner.arch.hidden_size, runner.dtype)
