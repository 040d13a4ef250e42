"""Where KV lives in the worker: the page pool tensors (`pool`) and the host and disk
tiers under them (`tiers`, `disk`)."""
