"""tforce eval: acceptance and needle evaluations and their report. (docs/architecture.md)"""
