"""Decide: pure policies, observations in, levels out; no torch, no clock, no I/O."""
