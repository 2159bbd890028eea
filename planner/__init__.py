"""The planner: sizes the prefill and decode pools from the service's own measurements.

`policy` turns one `Snapshot` of measurements into a `Decision` (node counts and the reasons);
`actions` turns a decision into starts, drains, flips and stops; `sim` runs the same policy in
a discrete-event model of a deployment driven by a trace. Pure Python: no torch, no sockets.
"""
