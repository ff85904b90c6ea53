"""Generation: the Session and its levels, speculative verification, sampling, prefill, the decode loop, batches,
conversations, memory placement, CUDA graphs, timing (--method auto is chosen above it: tforce/auto).
(docs/architecture.md)"""
