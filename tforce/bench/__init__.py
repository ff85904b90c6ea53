"""tforce bench: runs and their records, the machine's ceilings, physical floors, transformers as a peer.
(docs/architecture.md)"""
