"""One file per block of the model; each is a pure function of (params, activations)."""
