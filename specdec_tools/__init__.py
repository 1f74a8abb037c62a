"""The composition layer, above the services: the `specdec` CLI and its commands, the local stack that `serve`
runs and supervises, the benchmark harness (`specdec bench`), demo-model training and tiny checkpoints. It may
import every other package; none of them imports it (tests/test_imports.py)."""
