"""The worker process: weights, the KV tensors, the forward pass, attention, sampling;
it reads the scheduler's page table and executes the batches it is sent."""
