"""Compute kernels, each beside a pure-torch reference with the same signature.

This package is `kernels` inside the specdec distribution; it is not the Hugging Face `kernels` hub package.
"""
