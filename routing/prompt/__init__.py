"""The prompt as the router and the worker both see it: block hashing, image and video token
layouts, the routing token view, the model's chat-template view and the processor view, and the
session-scope hash that salts them.

One pure unit: the frontend and the worker must compute identical block hashes from it, so both
import it and it imports nothing but `state`. `processor_view` is the one module that imports torch
(lazily, for transformers' chat processor), and only when a deployment asks for that view.
"""
