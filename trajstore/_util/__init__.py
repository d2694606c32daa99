"""Utilities every layer may use: pools, backoff, progress, argparse types, deprecations, auth."""
