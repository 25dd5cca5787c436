"""Observe: what the device holds at its fullest in a step (the memory probes)."""
