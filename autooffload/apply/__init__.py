"""Apply: find the checkpointed layers, swap their checkpoint function, and move saved inputs to the host."""
