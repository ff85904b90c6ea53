"""KV snapshots on disk: their format, identity, saving and loading, reading. (docs/architecture.md)"""
