"""The head's speculative engine (engine.py) and its measured-gain fallback (gain.py).

The drafters it drives are in :mod:`edgespec.drafters`.
"""
