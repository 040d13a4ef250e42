"""The scheduler process: requests, their queues and states, the cache manager (pages,
page table, radix tree, row slots), planning and committing each step."""
