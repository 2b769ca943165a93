"""Training (the training issue builds it here)."""
