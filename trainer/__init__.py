"""Offline drafter training for tlt-serve (``tlt-train warmup``)."""
