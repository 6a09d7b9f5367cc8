"""Host memory for tensors; the arenas, the budget that bounds them, pages given back
to the kernel and pages copied between ranks."""
