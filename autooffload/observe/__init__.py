"""Observe: what the model is (its checkpointed layers, stacks and sizes), what each micro-batch runs, and what
the device holds."""
