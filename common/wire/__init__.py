"""What crosses sockets: typed messages and the values they carry (payloads), the control link,
and CurveZMQ security.

Nothing here imports torch or the engine: the router loads this package, never the model; the
engine takes its sampling parameters and token values from here.
"""
