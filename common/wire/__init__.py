"""What crosses sockets: messages and their codecs, the control link, and CurveZMQ security.

Nothing here imports torch or the engine: the router loads this package, never the model.
"""
