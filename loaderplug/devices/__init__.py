"""The device backends: how landed bytes reach an accelerator's memory.

What a backend is (:mod:`.backend`), the CUDA one (:mod:`.cuda`) and the page-locked
buffers the engine reads into for it, made once per process (:mod:`.pinned`). Knows
nothing of jobs, files or safetensors.
"""
