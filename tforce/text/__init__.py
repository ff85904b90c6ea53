"""Text in and out: prompt formats and chat templates, dated templates, the demo prompt, needle prompts, streamed
output. (docs/architecture.md)"""
