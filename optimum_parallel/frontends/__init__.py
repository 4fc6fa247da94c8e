"""The public entry points: optimum-neuron's Parallelizer/ParallelizersManager and Paddle's `parallelize(...)`."""
