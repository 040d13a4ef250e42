"""Tensor parallelism: the rank group (`group`), a rank's process (`rank`) and the step
every rank runs in lockstep (`step`). Rank 0 lives in the worker process."""
