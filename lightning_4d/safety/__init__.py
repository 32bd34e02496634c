"""A run that fails loudly and early: the non-finite guard, preemption with a checkpoint, the heartbeat that ends
a frozen run, and the peer named when one dies."""
