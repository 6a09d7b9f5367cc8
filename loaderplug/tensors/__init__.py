"""Tensors: safetensors files read as tensors while their bytes land.

The header and dtypes (:mod:`.header`, :mod:`.dtypes`), a load as a plan
(:mod:`.load_plan`), the sinks that turn landed ranges into tensors (:mod:`.sinks`,
:mod:`.staging`, :mod:`.budget`, :mod:`.page_release`), how tensors are handed over
(:mod:`.delivery`), ranks sharing a load (:mod:`.ranks`, :mod:`.peers`), and the public
readers (:mod:`.reader`).
"""
