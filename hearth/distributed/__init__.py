"""One model over several processes: tensor_parallel.py (by heads and vocabulary rows) and
pipeline_parallel.py (by layers), transforms of the loaded model; collectives.py, what its ranks
meet in. The processes themselves are the engine's (hearth/engine/workers.py)."""
