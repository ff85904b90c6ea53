"""The Llama-family network, its attention, the weights and their formats (safetensors, .bin, GGUF, the Hub), the
families, tensor-parallel sharding of weights, the default models and synthetic checkpoints.
(docs/architecture.md)"""
