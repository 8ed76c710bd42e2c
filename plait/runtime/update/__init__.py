"""The optimizer step's guards and scalings: non-finite steps, the global gradient norm and its clipping."""
