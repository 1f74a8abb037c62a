"""Training a small Qwen3.5 + MTP demo model on the Python standard library (see train_demo)."""
