"""Engine flags that give an earlier decode path from today's tree, shared by the scripts that
compare against it (bench_engine's ``eager`` side, profile_decode_step's ``onednn`` model)."""

# the decode step without pdserve's native products: no native gemv for small steps, no native
# panel products for larger ones, so every linear is oneDNN's prepacked one (today's other
# kernels stay)
ONEDNN_LINEARS = dict(disable_decode_gemv=True, disable_native_gemm=True)
