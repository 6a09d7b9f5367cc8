"""How each file of a load is served (mapped, read whole into memory of its own, or by
the engine) and its tensors handed over as they complete."""
