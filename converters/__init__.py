"""Converters that turn other formats into what mlx-mtp loads.

Installed as ``mlx_mtp.converters`` (the repo folder ``converters/`` is mapped
into the package namespace): ``gguf`` (llama-architecture GGUF files -> MLX
model folders).
"""
