"""The frontend ↔ worker contract: task names and typed payloads (`tasks`), and the per-request
response stream a worker writes and the frontend follows (`responses`).

Imported by both sides. Pure but for the response stream's Redis calls; never imports Django,
torch, `workers` or `inference_platform`.
"""
