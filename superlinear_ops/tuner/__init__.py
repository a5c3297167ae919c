"""The Optuna-driven tuner: workloads, inputs, measurement, the search, and the tune/verify/bench commands."""
