"""Trainers (importable as ``trace_gym.trainers``)."""
