"""A rank's memory at run time: activations held, live bytes and memory by kind."""
