"""Serving one chat request, from admission to its last byte, beneath the HTTP API.

`inference_platform.api` parses and formats; this package prepares a request (prompt, images,
token view), decides and sends it, follows the worker's answer and frees what it took. It never
imports the API above it.
"""
