"""The autoscaler's trace-replay simulator: `kvgate sim`.

traces and shapes (Azure/Mooncake loaders, rate scaling, synthetic shapes) -> engine (a discrete-event loop on
simulated time: the service model of `service`, and each tick the live loop's own decision, `autoscaler.decide`,
over simulated nodes, `nodes`) -> compare (kvgate's replica step and the baselines of `baselines`, the oracle's
search of `oracle` and the lower bound of `bound`, one table) -> report (table, JSON, PNG). `records` holds the types.
`--shared-slurm`: sharing (kvgate on one Slurm cluster shared with a training backlog, against separate clusters)
over training (the backlog and the GPU ledger, hooked into the engine).
"""
