"""Ray Tune sweeps: `sweep()` (sweep.py), the space (space.py), one trial (trial.py),
driver-side Tune callbacks (callbacks.py), results (results.py) and `rtp sweep` (command.py)."""
