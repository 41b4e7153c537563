"""Replica scaler, forecast, node planner, reconciler and trace-replay simulator. Built in the
autoscaler issue."""
