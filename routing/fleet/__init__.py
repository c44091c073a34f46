"""The fleet: live worker heartbeats (`registry`), the operator's rows as frontends read them
(`worker_rows`, which reads Django's rows lazily), and the encode workers of E/PD (`encoders`), and the
models' routing files that workers publish for frontends (`model_cards`).

Workers write their heartbeats through `registry`; the frontend reads all three.
"""
