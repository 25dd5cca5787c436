"""Probes: short scripts that each answered one question once, for one results folder (benchmarks/README.md lists
them). Each names in its docstring the question, the folder under benchmarks/results/ it produced and the command
that reruns it. They import the package and the benchmark scripts beside this folder, never each other; nothing
imports a probe (tests/test_benchmarks_imports.py)."""
