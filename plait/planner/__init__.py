"""Planning on the live job: profiling the model, timing the links, choosing the layout, checking and re-planning it."""
