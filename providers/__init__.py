"""One `Provider` interface (modelled on Karpenter's CloudProvider) and its implementations.

- `providers.base`: the protocol, value types (Offering, NodeClaim, Node, ReplicaSpec, ReplicaHandle),
  typed errors and pure helpers (replica_spec_for, engine_args, offerings_from_pool, node_tags).
- `providers.build.build_provider`: picks the implementation for a registry Pool.
- `providers.fake`: in memory, on an injected clock, with fault injection (tests, the simulator).
- `providers.local`: slots on this machine, `kvgate engine` child processes (the embedded default).
- `providers.aws`, `providers.kubernetes`: the clouds; their SDKs are imported only there.

This package module imports nothing, so importing a provider never drags in another one's SDK.
"""
