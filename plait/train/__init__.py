"""The parts of `plait.Model`'s training, each its own module: the start on a rank, the build of its pipeline, the fit loop and the export of the weights."""
