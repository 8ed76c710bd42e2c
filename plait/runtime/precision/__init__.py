"""Low-precision compute over fp32 master weights (`Plan.precision`)."""
