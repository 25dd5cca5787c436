"""Plugins for training frameworks that take them (axolotl); each imports without its framework."""
