"""Weight-absorbed MLA decode attention over latent pages: the native CPU kernel
(``cpu_mla_decode.c``) and its torch twin (CUDA, and the reference the tests hold it to).

Each decode row's query is already in latent space: ``q = [q_nope W_UK, q_pe]`` per head,
``[H, kv_lora_rank + rope_dim]``. A cached token is one latent vector ``[c, k_pe]`` of the same
width, shared by every head, so a score is one dot product over the whole width and the output
is the probabilities times ``c`` (the caller folds W_UV in afterwards). The pool tensor is the
latent pool's ``[1, num_pages, page_size, width]``.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels.cpu_native import NativeKernels, native_kernels
from pdserve.kernels.kv_ops import gather_pages

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def mla_decode_torch(q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                     kv_lora_rank: int, scale: float) -> torch.Tensor:
    """q [n, H, W]; cache [1, pages, page_size, W]; page_table [n, P]; seq_lens [n] ->
    [n, H, kv_lora_rank]: softmax(scale q . latent) @ c over each row's first seq_lens tokens."""
    latent = gather_pages(cache, page_table.long())[:, :, 0]  # [n, L, W]
    L = latent.shape[1]
    s = torch.bmm(q, latent.transpose(1, 2)).float() * scale  # [n, H, L]
    pad = torch.arange(L, device=q.device)[None, :] >= seq_lens.to(q.device)[:, None]  # [n, L]
    s.masked_fill_(pad[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.bmm(p, latent[:, :, :kv_lora_rank])  # [n, H, r]


class MLADecodeKernel:
    """The bound ``mla_decode`` of one native library. ``portable``: the plain loops even where
    AVX-512 BF16 is compiled in (the tests cover both paths)."""

    def __init__(self, native: NativeKernels, portable: bool = False):
        self._fn = native.lib.mla_decode
        self._fn.argtypes = [_P, _P, _P, _P, _P] + [_I64] * 7 + [_F, _I32, _I32]
        self._fn.restype = ctypes.c_int
        self.isa = "avx512" if native.lib.mla_decode_isa() == 512 and not portable else "portable"
        self.portable = portable

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                 kv_lora_rank: int, scale: float) -> torch.Tensor:
        """``mla_decode_torch``'s contract, on CPU in bf16 or float32; float32 softmax and sums."""
        n, H, W = q.shape
        _, num_pages, page_size, cw = cache.shape
        assert q.dtype == cache.dtype and q.dtype in (torch.bfloat16, torch.float32) and cw == W
        assert cache.is_contiguous() and cache.shape[0] == 1
        q = q.contiguous()
        pages = page_table.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        out = torch.empty(n, H, kv_lora_rank, dtype=q.dtype)
        rc = self._fn(q.data_ptr(), cache.data_ptr(), pages.data_ptr(), lens.data_ptr(), out.data_ptr(), n, H, W,
                      kv_lora_rank, page_size, pages.shape[1], num_pages, scale, int(q.dtype == torch.bfloat16),
                      int(self.portable))
        if rc != 0:
            raise ValueError(f"a page id of the MLA decode's page table is outside the pool's {num_pages} pages")
        return out


def mla_decode_fn(device: torch.device):
    """The absorbed decode for a pool on ``device``: the native kernel on CPU where it is built,
    the torch twin elsewhere (CUDA: FlashInfer's MLA runs in its attention backend)."""
    native = native_kernels() if device.type == "cpu" else None
    return MLADecodeKernel(native) if native is not None else mla_decode_torch
