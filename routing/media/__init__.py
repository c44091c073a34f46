"""Media a request carries: image identity, guarded fetching and header-only sizes (`images`),
video decoding and sampling (`video`), and the side store that carries bytes to the worker
(`store`).

Imported by the frontend and the workers; imports `state` and `prompt` only.
"""
