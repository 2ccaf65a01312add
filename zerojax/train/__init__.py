"""Training: the loop behind `train.py`, its configs and outputs, data, orbax checkpoints, signals, optimizers."""
