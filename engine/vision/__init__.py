"""Kimi K3 image input: preprocessing (`processor`, torch-free until tensors are made), the MoonViT3d tower
(`tower`), the `patchmergerv2` projector and the encoder that runs both (`encoder`), and loading their weights
(`loader`). The language model takes the encoder's rows as input embeddings at `<|media_pad|>` positions
(`ForwardBatch.mm_embeds` / `mm_positions`, engine/model/batch.py).

Importing this package imports nothing (the gateway may use the processor without torch).
"""
