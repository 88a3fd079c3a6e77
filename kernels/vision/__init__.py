"""kernels/vision: non-causal attention within each image of a packed batch (the MoonViT tower's attention).

`naive.py` (oracle: plain softmax attention per image, fp32), `torch_sdpa.py` (`scaled_dot_product_attention` per
image). Pick an implementation with `kernels.registry.get_kernel("vision_attention", device)`.
"""
