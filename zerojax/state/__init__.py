"""State across steps and where the train state lives: the stateful protocol, the train state, qgZ's error feedback, Radius, DiLoCo and the placement (docs/DESIGN.md, "State across steps")."""
