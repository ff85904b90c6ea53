"""Tensor parallelism: the ranks, their worker processes, generation and chat across them. (docs/architecture.md)"""
