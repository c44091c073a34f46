"""Process and Redis plumbing every other routing package builds on: the connection and the
deployment's key prefix, one-command calls past redis-py's machinery, Lua loading, the small
expiring in-process map, and the pacing of long passes in a thread beside an event loop.

Imported by anyone (frontend, workers, every routing sub-package); imports nothing of the project.
"""
