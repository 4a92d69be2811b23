"""Importers that turn other formats into what mlx-mtp loads.

Installed as ``mlx_mtp.converters`` (the repo folder ``converters/`` is mapped
into the package namespace): ``gguf`` (llama-architecture GGUF files -> MLX
model folders), ``clp_import`` (Medusa heads, MiMo / Qwen3.5 / DeepSeek-V3 MTP
layers -> the heads folders of :mod:`mlx_mtp.clp_format`) and
``confadapt_import`` (self-distilled MTP checkpoints -> MLX model folders with
the metadata of :mod:`mlx_mtp.confadapt_format`).
"""
