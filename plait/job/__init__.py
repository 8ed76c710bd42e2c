"""The job: which launcher started this process, its rank and world, the process group, and `plait run`."""
