"""Generation: the Session and its levels, speculative verification, sampling, prefill, the decode loop, batches,
conversations, memory placement, CUDA graphs, timing, and --method auto's planner and calibration.
(docs/architecture.md)"""
