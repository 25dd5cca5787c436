"""The parts of ``simulate.py``, the policies replayed on a simulated device: ``device`` (the scenarios, the memory
model, its calibration, the traces) below ``policies`` (the policies and the replay of one over a trace)."""
