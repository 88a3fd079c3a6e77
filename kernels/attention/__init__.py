"""kernels/attention: MLA attention over a paged latent cache.

`naive.py` (oracle), `torch_paged.py` (CPU path + `write_kv_cache`), `triton_paged.py` (Triton), `flashinfer_mla.py`
(FlashInfer, CUDA only). Pick an implementation with `kernels.registry.get_kernel("mla_attention", device)`.
"""
