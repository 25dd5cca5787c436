"""Apply: install the plan: the checkpoint function on every planned layer, the hooks a micro-batch enters
through, the engines that move saved inputs to the host and the host buffers they use."""
