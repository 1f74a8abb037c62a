"""The shared core: config, models and their loader, the drafting interface, sampling parameters, transports and
the generated wire stubs. It imports kernels/ and nothing above it: no service, no tool (tests/test_imports.py)."""
