"""What crosses sockets: typed messages, the control link, and CurveZMQ security.

Nothing here imports torch: the router loads this package, never the model. Of the engine it
takes only the plain value types that travel in messages (SamplingParams, TokenLogprobs).
"""
