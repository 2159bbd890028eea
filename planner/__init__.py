"""The planner: sizes the prefill and decode pools from the service's own measurements.

`policy` turns one `Snapshot` of measurements into a `Decision` (node counts and the reasons);
`actions` turns a decision into starts, drains, flips and stops; `sim` runs the same policy in
a discrete-event model of a deployment driven by a trace; those are pure Python (no torch, no
sockets). `loop` runs the policy on a real deployment: `source` reads the routers, and an
executor acts (the supervisor of `pdserve serve`, or `k8s` on Kubernetes).
"""
