"""The autoscaler's trace-replay simulator: `kvgate sim`.

traces (Azure/Mooncake loaders, rate scaling, time compression, a bursty generator) -> engine (a
discrete-event loop on simulated time running a policy's decisions against the service model of
`service`) -> compare (kvgate's `decide_replicas` and the baselines of `baselines`, one table) ->
report (table, JSON, PNG).
"""
