"""Adapters that let trainers people already run (TRL, verl) take their rollouts from rollstream."""
