"""The engine: the flat sharded layout, the model, the compiled components of a plan, the ZeRO unit and its call orders, remat and host offload (docs/DESIGN.md, "Layers")."""
