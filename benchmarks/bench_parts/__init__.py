"""The parts of ``bench.py``: ``report``, its tables and figure."""
