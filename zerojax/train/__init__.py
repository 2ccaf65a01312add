"""Training: the loop behind `train.py`, data, orbax checkpoints, signals, optimizers, gin registration."""
