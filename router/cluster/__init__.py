"""The router's view of the cluster: node registry, routing policies, and the ZMQ backend.

Nodes connect DEALER sockets to the router's ROUTER socket and register; heartbeats carry
their load. A request on the P/D path goes: ReserveKV to a decode node (it allocates the
prompt's blocks or answers Busy), Prefill to a prefill node with the reserved blocks as the
destination; the prefill node streams the first token here and hands the KV to the decode
node, which streams the rest.

Modules, from the bottom up: registry (NodeInfo, which nodes are alive), streams (what is in
flight with the nodes: the ROUTER socket with the asks waiting on it, one request's state, and
RequestTable, the owner of where every request runs), registration (nodes joining), routing
(where a request goes: the policies' orderings of candidate nodes and local or remote prefill;
and putting it there, again after a failover), backend (ClusterBackend: the wiring of messages,
leases and streams); beside them timing (one request's time to first token by stage, which the
router's GenerateRequest carries down and the cluster fills in). The package imports none of
them itself: `router.backend` imports timing from here, and `cluster.backend` imports
`router.backend`.
"""
