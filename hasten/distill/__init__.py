"""Smaller models from the one you serve: layer pruning healed by distillation (`hasten distill`)."""
