"""Attention: one layer that reads the forward context, and interchangeable backends behind it."""
