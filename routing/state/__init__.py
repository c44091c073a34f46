"""Process and Redis plumbing every other routing package builds on: the connection and the
deployment's key prefix, one-command calls past redis-py's machinery, Lua loading, and the small
expiring in-process map.

Imported by anyone (frontend, workers, every routing sub-package); imports nothing of the project.
"""
