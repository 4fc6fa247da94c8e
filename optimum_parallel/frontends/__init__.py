"""The front doors: optimum-neuron's Parallelizer/ParallelizersManager and Paddle's `parallelize(...)`."""
