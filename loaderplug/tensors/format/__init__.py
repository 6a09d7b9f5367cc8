"""The safetensors format, parsed within bounds; its dtypes as stored and as torch
knows them, its tensor table, and which tensors a landed range completes."""
